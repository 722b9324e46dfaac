"""Policies: the built-ins, user entrypoints, and the OpenAI agent loop against a loopback server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness_fixtures import OpenAIStub, local_provider, median_env, needs_sandbox

from harness.actors import EpisodeWorker
from harness.episode import EpisodeRequest
from harness.errors import ConfigError, PolicyError
from harness.policy import DONE, CommandPolicy, Observation, OpenAIPolicy, Policy, is_done, make_policy


def drive(policy, outputs: list[str] = ()) -> list[str]:
    """Run a policy against canned command outputs; the actions it chose."""
    actions, obs = [], Observation(t=0, prompt="p")
    for t in range(10):
        action = policy.act(obs)
        if is_done(action):
            break
        actions.append(action)
        out = outputs[t] if t < len(outputs) else ""
        obs = Observation(t=t + 1, prompt="p", command=action, exit_code=0, stdout=out)
    return actions


def test_command_policy_runs_once() -> None:
    p = make_policy({"kind": "command", "command": "cp a b"})
    assert isinstance(p, CommandPolicy) and isinstance(p, Policy)
    assert drive(p) == ["cp a b"]


def test_script_policy_runs_each_command() -> None:
    assert drive(make_policy({"kind": "script", "commands": ["a", "b", "c"]})) == ["a", "b", "c"]


def test_done_and_none_stop() -> None:
    assert is_done(DONE) and is_done(None) and is_done(" done\n") and not is_done("ls")


@pytest.mark.parametrize("cfg,match", [
    ({"kind": "command"}, "policy.command"),
    ({"kind": "script"}, "policy.commands"),
    ({"kind": "python"}, "policy.entrypoint"),
    ({"kind": "python", "entrypoint": "nocolon"}, "module:attr"),
    ({"kind": "openai", "model": "m"}, "policy.base_url"),
    ({"kind": "bogus"}, "unknown policy.kind 'bogus'"),
])
def test_config_errors(cfg: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_policy(cfg)


@pytest.fixture
def user_module(tmp_path: Path) -> Path:
    (tmp_path / "mypolicies.py").write_text(
        "class Fixer:\n"
        "    def __init__(self, target='task/stats.py'):\n"
        "        self.target = target\n"
        "    def act(self, obs):\n"
        "        if obs.t == 0: return 'ls'\n"
        "        if obs.t == 1 and 'policies' in obs.stdout: return f'cp policies/1.py {self.target}'\n"
        "        return 'done'\n"
        "def one_shot(obs):\n"
        "    return 'echo hi' if obs.t == 0 else None\n"
    )
    return tmp_path


def test_python_class_entrypoint_is_multi_step(user_module: Path) -> None:
    p = make_policy({"kind": "python", "entrypoint": "mypolicies:Fixer", "args": {"target": "x.py"},
                     "python_path": [str(user_module)]})
    assert drive(p, ["grade.py policies task"]) == ["ls", "cp policies/1.py x.py"]


def test_python_function_entrypoint(user_module: Path) -> None:
    p = make_policy({"kind": "python", "entrypoint": "mypolicies:one_shot", "python_path": [str(user_module)]})
    assert drive(p) == ["echo hi"]


def test_python_missing_entrypoint_is_a_policy_error(user_module: Path) -> None:
    with pytest.raises(PolicyError, match="cannot load policy.entrypoint"):
        make_policy({"kind": "python", "entrypoint": "mypolicies:Nope", "python_path": [str(user_module)]})


def test_openai_loop_sends_tool_results_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_KEY", "sekret")
    with OpenAIStub(["ls", "cat x"]) as stub:
        p = make_policy({"kind": "openai", "base_url": stub.base_url, "model": "tiny", "api_key_env": "TEST_KEY",
                         "temperature": 0.5, "prompt": "fix the bug"})
        assert isinstance(p, OpenAIPolicy)
        assert drive(p, ["file-list", "contents"]) == ["ls", "cat x"]
        p.close()
    assert len(stub.requests) == 3
    first, last = stub.requests[0], stub.requests[-1]
    assert first["model"] == "tiny" and first["temperature"] == 0.5
    assert first["tools"][0]["function"]["name"] == "bash"
    assert first["messages"][1] == {"role": "user", "content": "fix the bug"}
    tools = [m for m in last["messages"] if m["role"] == "tool"]
    assert [t["tool_call_id"] for t in tools] == ["call_0", "call_1"]
    assert "file-list" in tools[0]["content"] and "contents" in tools[1]["content"]
    assert stub.headers[0].get("Authorization") == "Bearer sekret"


def test_openai_several_tool_calls_in_one_reply() -> None:
    with OpenAIStub(["a", "b", "c"], calls_per_reply=2) as stub:
        p = make_policy({"kind": "openai", "base_url": stub.base_url, "model": "m", "api_key_env": "NO_SUCH_VAR"})
        assert drive(p) == ["a", "b", "c"]
    # Every tool call got its result before the next request.
    assert len(stub.requests) == 3
    assert "Authorization" not in stub.headers[0]


def test_openai_server_error_is_one_line_policy_error() -> None:
    with OpenAIStub([], status=500) as stub:
        p = make_policy({"kind": "openai", "base_url": stub.base_url, "model": "m"})
        with pytest.raises(PolicyError, match="answered 500") as exc:
            p.act(Observation(t=0))
    assert "\n" not in str(exc.value)


@needs_sandbox
def test_openai_policy_solves_median_in_a_real_sandbox() -> None:
    """End to end: the agent loop fixes the bug through the bash tool; reward 1.0."""
    built = median_env()
    commands = ["cat task/stats.py", "cp policies/1.py task/stats.py", ".venv/bin/python -m pytest -q task | tail -1"]
    with OpenAIStub(commands) as stub, local_provider() as provider:
        worker = EpisodeWorker(built.snapshot, built.spec.grade, provider=provider, name="t")
        req = EpisodeRequest(run_id="openai", episode_id=0, method="new_from", max_steps=10,
                             policy={"kind": "openai", "base_url": stub.base_url, "model": "m", "prompt": "fix"})
        result = worker.run(req)
        worker.close()
    assert result.error is None, result.error
    assert result.reward == 1.0 and result.terminated and len(result.steps) == 3
    assert "return xs[len(xs) // 2]" in result.steps[0].new_obs.stdout
    assert "4 passed" in result.steps[2].new_obs.stdout
    # the model saw the real sandbox output
    assert "4 passed" in json.dumps(stub.requests[-1]["messages"])
