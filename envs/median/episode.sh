#!/bin/bash
# One episode. The policy edits the task, the grader scores it.
set -e
cd ~/env
cp "policies/$POLICY.py" task/stats.py      # stand-in for your agent's action
.venv/bin/python grade.py
