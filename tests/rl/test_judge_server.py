"""The self-served judge (rl/judge_server.py): the tiny base checkpoint on the project's own
engine behind its OpenAI front, grading criteria end to end.

A tiny model's verdicts are noise; what is checked is the plumbing: every judge criterion gets
a verdict or a judge_error, a malformed reply is a judge_error and never a pass, and the
verdicts are what the served model answers (greedy, so asking again gives the same reply).
"""
import json
import urllib.request

import pytest

from configs import tiny_cpu
from envs import judge as judge_lib
from envs.tasks import rubric
from envs.tasks.task import Task
from rl import evaluation
from rl import judge_server
from rl import learner


def _ask(url: str, model: str, messages: list, max_tokens: int) -> str:
  body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                     "temperature": 0.0}).encode()
  req = urllib.request.Request(url + "/chat/completions", data=body,
                               headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=300) as r:
    return json.loads(r.read())["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_tiny_base_served_as_judge_gives_every_criterion_a_verdict_or_judge_error():
  config = tiny_cpu.get_config()
  config.envs.judge.checkpoint = tiny_cpu.BASE_CHECKPOINT
  config.envs.judge.max_tokens = 24
  config.envs.judge.retries = 1
  config.envs.judge.timeout_s = 300.0
  config.envs.judge.max_file_chars = 400
  config.lock()
  crits = [{"type": "judge", "instruction": t, "description": t} for t in (
      "The answer states the revenue.", "The answer is polite.", "The answer names a date.")]
  task = Task(id="t", split="eval", domain="d", world_id="w", level=1, family="f",
              prompt="What was the revenue in 2024?", input_files={},
              rubric=(dict(type="answer_text", text="412.5"),) + tuple(crits), oracle_steps=(),
              oracle_answer="", weights=(1, 1, 1, 1))
  with judge_server.judged(config, warmup=False) as cfg:
    assert config.envs.judge.endpoint == ""            # the run's config is left as it was
    url, model = cfg.envs.judge.endpoint, cfg.envs.judge.model
    assert url.startswith("http://localhost:") and model == "tiny_base"
    g = rubric.grade(task, "Revenue was 412.5 in 2024.", "", "", cfg.envs)
    j = judge_lib.for_config(cfg.envs.judge)
    assert j.stats["verdicts"] + j.stats["judge_errors"] == 3
    assert g.results[0].passed
    for c, r in zip(crits, g.results[1:]):
      # What the served model answers to the same messages decides the verdict.
      msgs = judge_lib.build_messages(task, c, "Revenue was 412.5 in 2024.", {}, 400)
      reply = _ask(url, model, msgs, 24)
      try:
        expected = judge_lib.parse_verdict(reply).met
      except judge_lib.MalformedVerdict:
        expected = None
      if expected is None:
        assert not r.passed and r.detail.startswith(judge_lib.JUDGE_ERROR), (reply, r)
      else:
        assert r.passed == expected and not r.detail.startswith(judge_lib.JUDGE_ERROR)
    n = sum(r.passed for r in g.results)
    assert g.reward == pytest.approx(n / 4) and g.passed == (n == 4)


def _judge_tasks_config(tmp_path):
  """tiny_cpu over a task file whose tasks have a judge criterion, no judge configured."""
  world = tmp_path / "world"
  (world / "files").mkdir(parents=True)
  (world / "files" / "note.txt").write_text("hello")
  path = tmp_path / "tasks.jsonl"
  path.write_text("\n".join(json.dumps({
      "id": f"t-{s}", "split": s, "domain": "d", "world_dir": str(world), "prompt": "Greet.",
      "rubric": [{"type": "judge", "instruction": "The reply greets politely."}]})
      for s in ("train", "eval")) + "\n")
  config = tiny_cpu.get_config()
  config.workdir = str(tmp_path / "runs")
  config.envs.tasks_file = str(path)
  config.loop.sft_first = False
  return config


def test_rl_mode_with_judge_criteria_and_no_judge_stops_before_training(tmp_path):
  config = _judge_tasks_config(tmp_path)
  with pytest.raises(judge_lib.JudgeUnavailable,
                     match=r"envs\.judge\.endpoint.*envs\.judge\.checkpoint"):
    learner.run_rl(config)
  assert not (tmp_path / "runs" / config.name / "checkpoints").exists()


def test_eval_mode_with_judge_criteria_and_no_judge_stops_before_any_episode(tmp_path, capsys):
  config = _judge_tasks_config(tmp_path)
  config.policy = "oracle"
  with pytest.raises(judge_lib.JudgeUnavailable, match=r"envs\.judge\.endpoint"):
    evaluation.main_eval(config)
  assert "worlds ready" not in capsys.readouterr().out
