"""One full RL cycle (rollout + train + weight sync) of megatron-gspo vs TRL's GRPOTrainer.

Both run GSPO (sequence-level importance ratio, `loss_type="grpo"` aggregation, clip 3e-4/4e-4,
no KL) on the same HF Qwen3-MoE, prompts, reward, group size (8 prompts x 8 completions), sampling
(temperature 1, no top-k/top-p) and off-policy schedule (each rollout batch of 64 split into 4
minibatch updates of 16, as in the GSPO paper); fp32, no gradient checkpointing, router aux loss 0,
the same number of torch threads. Ours is the real loop (`megatron-gspo train`: built-in rollout
server, Megatron actor, weight sync over the tensor transport), timed per phase from its
metrics.jsonl; TRL is timed per generation cycle (one generation + 4 optimizer steps) by wrapping
its generation and reward methods. Completions stop at EOS on both sides; the mean completion
length of each is printed.

Two sizes: `tiny` (~0.1M params, 16-token completions: fixed overheads dominate) and `small`
(~90M params, 32 experts top-2, 128-token completions: the work dominates). For each size the two
stacks run side by side (harness.measure: alternating which goes first), `--rounds` times each,
every run a fresh process; the first `--warmup` cycles
of a run are dropped (start-up effects) and the medians of the rest are reported. The ratio printed last is TRL's
cycle time / ours (> 1: ours is faster); goals: >= 1.5 at `small`, >= 0.67 at `tiny`. The load
average is printed before each size and at the end: other work on the machine slows both stacks,
not always equally.

TRL is installed on first use into its own virtual environment ($TRL_VENV, default
~/.cache/megatron-gspo/trl-venv) that sees this environment's packages (torch, transformers)
through a .pth file, so nothing here is changed and torch is not downloaded again.

    .venv/bin/python bench/bench_rl_step.py [--sizes tiny,small] [--rounds 2] [--cycles N]
                                            [--warmup N] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16"
PROMPTS, GROUP, MINIBATCHES = 8, 8, 4
LR, CLIP_LOW, CLIP_HIGH = 1e-5, 3e-4, 4e-4


@dataclass(frozen=True)
class Size:
    spec: dict  # TinySpec fields
    new_tokens: int
    cycles: int = 8  # RL cycles per run (default of --cycles)
    warmup: int = 2  # cycles dropped at the start of a run (default of --warmup)


SIZES = {
    "tiny": Size({"seed": 0}, 16),
    "small": Size(
        {"vocab_size": 8192, "hidden": 512, "layers": 6, "heads": 8, "kv_heads": 4,
         "head_dim": 64, "ffn": 1024, "moe_ffn": 256, "experts": 32, "topk": 2, "seed": 0},
        128, cycles=3, warmup=1,
    ),
}  # fmt: skip


# ---- the task both stacks train on ----------------------------------------------------------


def score(prompt, response: str, answer) -> float:
    """The reward (ours calls it as a reward plugin, TRL through `trl_reward`): the fraction of
    words in the response that are digits. Cheap, deterministic, and it varies within a group."""
    words = response.split()
    return sum(w.isdigit() for w in words) / max(len(words), 1)


def trl_reward(completions, **kwargs) -> list[float]:
    return [score(None, c, None) for c in completions]


def prompt_texts(n: int = 64) -> list[str]:
    rng = random.Random(0)
    ops = ["add", "sum", "max", "min", "sort", "reverse", "count"]
    return [
        f"what is {rng.choice(ops)} of " + " ".join(str(rng.randrange(10)) for _ in range(4)) + " ?"
        for _ in range(n)
    ]


# ---- TRL's environment ----------------------------------------------------------------------


def trl_python() -> Path:
    """The python of a venv with trl, built on first use; it shares this env's site-packages."""
    venv = Path(os.environ.get("TRL_VENV", Path.home() / ".cache/megatron-gspo/trl-venv"))
    py = venv / "bin" / "python"
    mark = venv / f".megatron-gspo-trl-{TRL_VERSION}"
    if mark.is_file() and _has_trl(py):
        return py
    print(f"building {venv} (pip install trl=={TRL_VERSION}.*, about a minute)", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    # Packages of this environment (torch, transformers) are found after the venv's own.
    Path(site, "_megatron_gspo_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}.*"], check=True)
    if not _has_trl(py):
        sys.exit(f"error: trl {TRL_VERSION} did not install into {venv}; remove it and retry")
    mark.touch()
    return py


def _has_trl(py: Path) -> bool:
    check = f"import trl, torch; assert trl.__version__.startswith('{TRL_VERSION}.')"
    return (
        py.exists() and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0
    )


# ---- one run of each stack ------------------------------------------------------------------


@dataclass
class Cycle:
    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float
    length: float  # mean completion tokens
    tokens_per_s: float = 0.0  # prompt + completion tokens of the batch / step_s


def run_ours(
    model: Path,
    data: Path,
    size: Size,
    cycles: int,
    threads: int,
    work: Path,
    nproc: int = 1,
    extra: tuple[str, ...] = (),
) -> list[Cycle]:
    """`megatron-gspo train` for `cycles` steps (under torchrun when nproc > 1); per-step times."""
    run_dir = Path(tempfile.mkdtemp(prefix="ours-", dir=work))
    run_dir.rmdir()
    overrides = [f"model.path={model}", *cycle_overrides(data, size), f"train.steps={cycles}",
                 *extra]  # fmt: skip
    cmd = [*_launcher(nproc), "train", "--config", CONFIG, "--run-dir", str(run_dir), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=bench_path())
    _check(subprocess.run(cmd, env=env, capture_output=True, text=True), "megatron-gspo")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [Cycle(r["time/rollout_s"], r["time/train_s"], r["time/sync_s"], r["time/step_s"],
                  r["response/length_mean"], r["tokens_per_s"])
            for r in rows if r["step"] >= 1]  # fmt: skip


CONFIG = str(ROOT / "configs" / "tiny_moe_gspo.yaml")  # (every field it sets is overridden)


def cycle_overrides(data: Path, size: Size) -> list[str]:
    """Our side of the cycle (on CONFIG): the task, the batch and the GSPO update as TRL's; the
    reward plugin needs bench/ on PYTHONPATH (`bench_path`)."""
    return [
        "model.dtype=float32", f"data.train={data}", f"data.eval={data}",
        "reward.fn=bench_rl_step:score", f"rollout.group_size={GROUP}",
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.max_new_tokens={size.new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "algo.loss=gspo",
        f"algo.clip_low={CLIP_LOW}", f"algo.clip_high={CLIP_HIGH}", f"algo.minibatches={MINIBATCHES}",
        "algo.routing_replay=none", f"optim.lr={LR}", "optim.clip_grad=1.0",
        f"train.micro_batch_size={PROMPTS * GROUP // MINIBATCHES}",
        "train.eval_every=0", "train.checkpoint_every=0", "logging.tensorboard=false",
        "logging.console=false", "sync.method=tensor",
    ]  # fmt: skip


def bench_path() -> str:
    """PYTHONPATH with bench/ in front (the reward plugin `bench_rl_step:score`)."""
    return os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))


def _launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "megatron_gspo"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "megatron_gspo.cli"]  # fmt: skip


def run_trl(
    py: Path, model: Path, size: Size, cycles: int, threads: int, work: Path
) -> list[Cycle]:
    out = Path(tempfile.mkdtemp(prefix="trl-", dir=work))
    cmd = [str(py), __file__, "--trl-worker", "--model", str(model), "--out", str(out),
           "--new-tokens", str(size.new_tokens), "--cycles", str(cycles), "--threads", str(threads)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    _check(subprocess.run(cmd, env=env, capture_output=True, text=True), "TRL")
    return [Cycle(**c) for c in json.loads((out / "cycles.json").read_text())]


def _check(proc: subprocess.CompletedProcess, who: str) -> None:
    if proc.returncode != 0:
        sys.exit(f"error: the {who} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


# ---- the TRL side, run inside TRL's venv ----------------------------------------------------


def trl_worker(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    config = GRPOConfig(
        output_dir=str(args.out), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, seed=0, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=MINIBATCHES, dataloader_num_workers=0,
        per_device_train_batch_size=PROMPTS * GROUP // MINIBATCHES,
        gradient_accumulation_steps=1, steps_per_generation=MINIBATCHES, num_generations=GROUP,
        max_steps=MINIBATCHES * (args.cycles + 1), max_completion_length=args.new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH, importance_sampling_level="sequence", loss_type="grpo",
        router_aux_loss_coef=0.0, model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": p} for p in prompt_texts()])
    trainer = GRPOTrainer(model=str(args.model), reward_funcs=trl_reward, args=config,
                          train_dataset=data)  # fmt: skip
    log = _instrument(trainer)
    trainer.train()
    log["starts"].append(time.perf_counter())  # closes the last cycle (dropped below: +1 cycle)
    cycles = []
    for i in range(args.cycles):
        step = log["starts"][i + 1] - log["starts"][i]
        rollout = log["gen"][i] + log["reward"][i]
        cycles.append({"rollout_s": rollout, "train_s": step - rollout, "sync_s": 0.0,
                       "step_s": step, "length": log["length"][i]})  # fmt: skip
    (args.out / "cycles.json").write_text(json.dumps(cycles))


def _instrument(trainer) -> dict[str, list[float]]:
    """Time TRL's generation cycle: its start, the generation and the reward scoring."""
    log: dict[str, list[float]] = {"starts": [], "gen": [], "reward": [], "length": []}

    def timed(name: str, fn, key: str | None = None):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            if key == "starts":
                log["starts"].append(t)
                log["gen"].append(0.0)
                log["reward"].append(0.0)
            out = fn(*a, **kw)
            if key is None:
                log[name][-1] += time.perf_counter() - t
            else:
                mask = out["completion_mask"]
                log["length"].append(float(mask.sum(1).float().mean()))
            return out

        return wrapper

    trainer._generate_and_score_completions = timed(
        "cycle", trainer._generate_and_score_completions, "starts"
    )
    trainer._generate = timed("gen", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    return log


# ---- driver ---------------------------------------------------------------------------------


def make_inputs(name: str, size: Size, work: Path) -> tuple[Path, Path, float]:
    from safetensors.torch import load_file

    from megatron_gspo.hf.tiny import TinySpec, make_tiny_model

    model = make_tiny_model(TinySpec(**size.spec), work / f"model-{name}")
    params = sum(t.numel() for f in model.glob("*.safetensors") for t in load_file(f).values())
    data = work / "prompts.jsonl"
    if not data.exists():
        rows = [json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompt_texts()]
        data.write_text("".join(rows))
    return model, data, params / 1e6


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench_size(name: str, args, py: Path, work: Path):
    """Both stacks side by side at one size: a harness Result whose samples are the kept cycles
    of every run (pooled: the medians are over cycles)."""
    from harness import Variant, measure, median

    size = SIZES[name]
    cycles = args.cycles or size.cycles
    warmup = size.warmup if args.warmup is None else args.warmup
    if cycles <= warmup:
        sys.exit(f"error: {name}: --cycles ({cycles}) must exceed --warmup ({warmup})")
    model, data, mparams = make_inputs(name, size, work)
    print(f"\n{name}: Qwen3-MoE {mparams:.2f}M params, {PROMPTS} prompts x {GROUP} completions of "
          f"<= {size.new_tokens} tokens, {MINIBATCHES} updates per rollout batch, "
          f"{args.threads} thread(s); load average {_load()}", flush=True)  # fmt: skip

    def ours():
        return [asdict(c) for c in run_ours(model, data, size, cycles, args.threads, work)[warmup:]]

    def trl():
        return [asdict(c) for c in run_trl(py, model, size, cycles, args.threads, work)[warmup:]]

    def show(who: str, rnd: int, got: list[dict]) -> None:
        step = median(c["step_s"] for c in got)
        print(f"  round {rnd + 1} {who:4s}: median cycle {step:.3f} s", flush=True)

    res = measure([Variant("ours", ours), Variant("trl", trl)], args.reps, on_sample=show)
    _table(res)
    return res


def _table(res) -> None:
    from harness import markdown_table

    rows = [[title, f"{res.median('ours', field):.3f}", f"{res.median('trl', field):.3f}"]
            for field, title in [("rollout_s", "rollout (s)"), ("train_s", "train (s)"),
                                 ("sync_s", "weight sync (s)"), ("step_s", "full cycle (s)"),
                                 ("length", "completion tokens")]]  # fmt: skip
    print(markdown_table(["median per cycle", "megatron-gspo", "TRL GRPOTrainer"], rows))


def main() -> None:
    from harness import Result, finish, parser  # (bench/ is on the path: run as a script)

    p = parser(__doc__, reps=2, warmup=None, reps_flags=("--rounds", "--reps"))
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--cycles", type=int, help="RL cycles per run (default: tiny 8, small 3)")
    p.add_argument("--warmup", type=int, help="cycles dropped per run (default: tiny 2, small 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each stack")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s not in SIZES for s in sizes):
        sys.exit(f"error: --sizes: choose from {', '.join(SIZES)}")
    py = trl_python()
    res, ratios = Result("rl_step"), {}
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        for name in sizes:
            got = bench_size(name, args, py, Path(tmp))
            ratios[name] = got.ratio("trl", "ours", "step_s")
            res.include(got, name)
    goals = {"tiny": 1 / 1.5, "small": 1.5}
    print("\nratio TRL cycle time / megatron-gspo cycle time (> 1: ours faster): " + ", ".join(
        f"{n} {r:.2f}x (goal >= {goals[n]:.2f}x)" for n, r in ratios.items()))  # fmt: skip
    print(f"load average {_load()}")
    finish(res, args)


if __name__ == "__main__":
    main()
