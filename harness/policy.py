"""Policies: see an observation, return an action (a shell command, or DONE).

A policy object lives for one episode (``make_policy`` builds a fresh one per
episode, so multi-step policies may keep state). Built-ins:

- ``command``: one templated command, then done (the seed's stand-in agent);
- ``script``: a fixed list of commands, one per step;
- ``python``: a user's class or function named by ``entrypoint: "module:attr"``;
- ``openai``: an agent loop against an OpenAI-compatible chat-completions server
  with one ``bash`` tool, over httpx.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from harness.errors import ConfigError, PolicyError

#: The action that ends an episode's acting phase (``None`` means the same).
DONE = "done"
KINDS = ("command", "script", "python", "openai")


@dataclass(frozen=True)
class Observation:
    """What a policy sees before step ``t``: the task and the previous step's outcome."""

    t: int
    prompt: str = ""
    command: str | None = None
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Policy(Protocol):
    def act(self, obs: Observation) -> str | None:
        """The next shell command to run in ``~/env``, or DONE / None to stop."""


def is_done(action: str | None) -> bool:
    return action is None or action.strip() == DONE


class CommandPolicy:
    """Runs one command, then stops."""

    def __init__(self, command: str):
        self.command = command

    def act(self, obs: Observation) -> str | None:
        return self.command if obs.t == 0 else DONE


class ScriptPolicy:
    """Runs a fixed list of commands, one per step, then stops."""

    def __init__(self, commands: Sequence[str]):
        self.commands = list(commands)

    def act(self, obs: Observation) -> str | None:
        return self.commands[obs.t] if obs.t < len(self.commands) else DONE


class FunctionPolicy:
    """Adapts a plain function ``f(obs) -> str | None`` to the protocol."""

    def __init__(self, fn: Callable[[Observation], str | None]):
        self.fn = fn

    def act(self, obs: Observation) -> str | None:
        return self.fn(obs)


BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in the task's sandbox (working directory ~/env) and "
        "return its exit code, stdout and stderr. Reply without a tool call when finished.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command, run by sh -c"}},
            "required": ["command"],
        },
    },
}

SYSTEM_PROMPT = (
    "You are an agent solving a task in a Linux sandbox. Use the bash tool to inspect and change "
    "files. When the task is solved, answer without calling a tool."
)


class OpenAIPolicy:
    """A chat-completions agent loop: each tool call is one step."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        temperature: float = 0.0,
        prompt: str = "",
        system: str = SYSTEM_PROMPT,
        request_timeout: float = 120.0,
        max_tool_output: int = 8000,
        client: httpx.Client | None = None,
    ):
        headers = {}
        if api_key_env and (key := os.environ.get(api_key_env)):
            headers["Authorization"] = f"Bearer {key}"
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.max_tool_output = model, temperature, max_tool_output
        self.client = client or httpx.Client(timeout=request_timeout, headers=headers)
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        if prompt:
            self.messages.append({"role": "user", "content": prompt})
        self.pending: list[tuple[str, str]] = []  # tool calls not yet run: (id, command)
        self.running: str | None = None  # id of the tool call whose result the next obs carries

    def _tool_result(self, obs: Observation) -> str:
        out = f"exit code: {obs.exit_code}{' (timed out)' if obs.timed_out else ''}\n"
        out += f"stdout:\n{obs.stdout[-self.max_tool_output:]}\nstderr:\n{obs.stderr[-self.max_tool_output:]}"
        return out

    def _complete(self) -> dict[str, Any]:
        body = {"model": self.model, "messages": self.messages, "tools": [BASH_TOOL],
                "temperature": self.temperature}
        try:
            resp = self.client.post(self.url, json=body)
            resp.raise_for_status()
            return resp.json()["choices"][0]["message"]
        except httpx.HTTPStatusError as exc:
            raise PolicyError(
                f"chat completions at {self.url} answered {exc.response.status_code}: "
                f"{exc.response.text[:200]!r}; check policy.base_url, policy.model and the API key"
            ) from exc
        except httpx.HTTPError as exc:
            raise PolicyError(f"chat completions at {self.url} failed: {exc}; check policy.base_url") from exc
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PolicyError(f"chat completions at {self.url} sent an unexpected reply: {exc!r}") from exc

    def act(self, obs: Observation) -> str | None:
        if self.running is not None:
            self.messages.append({"role": "tool", "tool_call_id": self.running, "content": self._tool_result(obs)})
            self.running = None
        if not self.pending:
            message = self._complete()
            # Echo the assistant turn back as sent (content may be null next to tool calls).
            self.messages.append({k: v for k, v in message.items() if v is not None or k == "content"})
            for call in message.get("tool_calls") or []:
                try:
                    args = json.loads(call["function"].get("arguments") or "{}")
                    command = str(args["command"])
                except (KeyError, TypeError, ValueError):
                    command = "echo 'invalid bash tool call: it needs a JSON object with a command' >&2; false"
                self.pending.append((call.get("id", f"call_{obs.t}"), command))
        if not self.pending:
            return DONE
        self.running, command = self.pending.pop(0)
        return command

    def close(self) -> None:
        self.client.close()


def load_entrypoint(entrypoint: str, python_path: Sequence[str] = ()) -> Any:
    """``"package.module:attr"`` imported, with ``python_path`` entries on ``sys.path``."""
    module_name, sep, attr = entrypoint.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"policy.entrypoint {entrypoint!r} must look like 'module:attr'")
    for path in reversed(list(python_path)):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PolicyError(
            f"cannot load policy.entrypoint {entrypoint!r}: {exc}; check the name and policy.python_path"
        ) from exc
    return obj


def make_policy(cfg: Mapping[str, Any]) -> Any:
    """A fresh policy for one episode from the resolved ``policy:`` config."""
    kind = cfg.get("kind", "command")
    if kind == "command":
        if not cfg.get("command"):
            raise ConfigError("policy.command is required for policy.kind=command")
        return CommandPolicy(str(cfg["command"]))
    if kind == "script":
        if not cfg.get("commands"):
            raise ConfigError("policy.commands (a list) is required for policy.kind=script")
        return ScriptPolicy([str(c) for c in cfg["commands"]])
    if kind == "python":
        if not cfg.get("entrypoint"):
            raise ConfigError("policy.entrypoint ('module:attr') is required for policy.kind=python")
        obj = load_entrypoint(str(cfg["entrypoint"]), cfg.get("python_path") or ())
        args = dict(cfg.get("args") or {})
        if inspect.isclass(obj):
            return obj(**args)
        if callable(obj):
            return FunctionPolicy(obj)
        raise PolicyError(f"policy.entrypoint {cfg['entrypoint']!r} is neither a class nor a function")
    if kind == "openai":
        for key in ("base_url", "model"):
            if not cfg.get(key):
                raise ConfigError(f"policy.{key} is required for policy.kind=openai")
        return OpenAIPolicy(
            base_url=str(cfg["base_url"]),
            model=str(cfg["model"]),
            api_key_env=str(cfg.get("api_key_env") or ""),
            temperature=float(cfg.get("temperature") or 0.0),
            prompt=str(cfg.get("prompt") or ""),
            request_timeout=float(cfg.get("request_timeout") or 120.0),
        )
    raise ConfigError(f"unknown policy.kind {kind!r}; use one of: {', '.join(KINDS)}")


def describe(cfg: Mapping[str, Any]) -> str:
    """A short label for tables and the dataset's ``policy`` column."""
    kind = cfg.get("kind", "command")
    if kind == "command":
        return str(cfg.get("command"))
    if kind == "script":
        return f"script[{len(cfg.get('commands') or [])}]"
    if kind == "python":
        return str(cfg.get("entrypoint"))
    return f"openai:{cfg.get('model')}"
