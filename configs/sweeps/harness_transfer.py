"""Does what RL teaches carry over to another harness? Train under the app tools (mcp) and under
shell tools (bash, read, write, edit, glob, grep), and evaluate before and after RL under both.

  python launch.py --config=configs/tiny_cpu.py --mode=rl --sweep=configs/sweeps/harness_transfer.py \
      --config.sft.dir=$PWD/runs/tiny_cpu/sft

Each arm is `make run`'s path with its held-out evals run twice (loop.eval_styles), so an arm
takes about 1.5 times `make run` on 2 cores (~12 minutes after the shared SFT). The sweep writes
the usual table and a second one: pass@1 before and after under each style, with the paired
change. Results and the command that produced them: docs/results.md, "Harness styles".
"""


def get_sweep(arg=None):
  del arg
  return [{"name": f"train_{style}", "harness.style": style, "loop.eval_styles": ("mcp", "shell")}
          for style in ("mcp", "shell")]
