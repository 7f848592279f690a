"""`megatron-gspo` command line: one subcommand per job.

Bad input raises `UserError`; it is printed as one line starting with "error:" and the process
exits with status 2, with nothing half-written left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import warnings
from pathlib import Path

from megatron_gspo.entry import run_command, terminate_stops
from megatron_gspo.errors import Interrupted, UserError
from megatron_gspo.outputs import signals_held
from megatron_gspo.train.flags import ALLOW_WITHOUT_RESUME, check_steps

# Each command imports what it runs with SIGINT and SIGTERM held (`signals_held`: they take
# effect once the import ends, a second or two). Those imports load torch, whose C++ module an
# interrupt cannot stop cleanly: it was lost (the command went on, a server came up serving), came
# out as a RuntimeError ("generic_type: cannot initialize type ..."), or left torch half-imported.


def _layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel layout (the number of processes must be a multiple)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    g.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per rank")
    g.add_argument("--ep", type=int, default=1, help="expert parallel size")
    g.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default tp)")


def _dims(args):
    from megatron_gspo.model.parallel import ParallelDims, world_size_from_env

    axes = dict(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    return ParallelDims(**axes, world_size=world_size_from_env())


def _wrote(line: str) -> None:
    """A command's last line, saying what it wrote (rank 0's, under torchrun)."""
    from megatron_gspo.comm import rank

    if rank() == 0:
        print(line, flush=True)


def _cmd_convert(args) -> None:
    with signals_held():
        from megatron_gspo.model.convert import hf_to_megatron
        from megatron_gspo.model.lora_export import PEFT_DIR, lora_to_hf
        from megatron_gspo.train.export import megatron_to_hf  # (a run's checkpoint too)

    if args.direction == "hf-to-megatron":
        hf_to_megatron(args.hf, args.out, _dims(args))
        _wrote(f"wrote {args.out} (Megatron checkpoint of {args.hf})")
    elif args.direction == "lora-to-hf":
        lora_to_hf(args.checkpoint, args.out, _dims(args), base=args.base)
        adapter = os.path.join(args.out, PEFT_DIR)
        _wrote(f"wrote {args.out} (HF model, adapters merged) and {adapter} (PEFT adapter)")
    else:
        megatron_to_hf(args.megatron, args.out, _dims(args))
        _wrote(f"wrote {args.out} (HF checkpoint of {args.megatron})")


def _cmd_score(args) -> None:
    with signals_held():
        from megatron_gspo.model.score_cmd import run_score
        from megatron_gspo.train.export import refuse_run_checkpoint

    refuse_run_checkpoint(Path(args.checkpoint), "--checkpoint")
    n = run_score(args.checkpoint, args.input, args.output, _dims(args), args.micro_batch_size)
    _wrote(f"wrote {args.output} ({n} sequences with their per-token log-probs)")


def _cmd_make_tiny(args) -> None:
    with signals_held():
        from megatron_gspo.hf.tiny import TinySpec, check_dense_flags, make_tiny_model

    # (an MoE flag not given is None: TinySpec's default applies, and a dense --arch refuses
    # only the flags given, whatever their value)
    fields = {k: v for k, v in vars(args).items()
              if k in TinySpec.__dataclass_fields__ and v is not None}  # fmt: skip
    check_dense_flags(args.arch, fields)
    try:
        make_tiny_model(TinySpec(**fields), args.out)
    except (FileExistsError, ValueError) as e:
        raise UserError(str(e)) from None
    print(f"wrote {args.out}")


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of layer ids, e.g. 0,3"
        ) from None


# make-tiny-model's integer flags: (name, default, help); make-task-model's shape flags too
_TINY_SHAPE = (
    ("vocab_size", 128, "vocabulary size"),
    ("hidden", 64, "hidden size"),
    ("layers", 2, "decoder layers"),
    ("heads", 4, "attention heads"),
    ("kv_heads", 2, "key-value heads (grouped-query attention)"),
    ("head_dim", 16, "size of one attention head"),
    ("ffn", 128, "dense MLP size (dense layers, dense architectures)"),
    ("moe_ffn", 32, "size of one expert's MLP"),
    ("experts", 8, "experts per MoE layer"),
    ("topk", 2, "experts per token"),
    ("seed", 0, "seed of the random weights"),
)


# make-tiny-model's flags that shape only an MoE model (--arch qwen3_moe): given with a dense
# --arch they are refused (hf/tiny.py), so they default to None, TinySpec's default when not given
_TINY_MOE = ("moe_ffn", "experts", "topk")


def _add_make_tiny(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="write a tiny random HF checkpoint with a tokenizer")
    p.add_argument("--out", required=True, help="new directory for the HF checkpoint")
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen3", "qwen2"],
                   help="HF architecture (qwen3_moe: MoE; qwen3, qwen2: dense)")  # fmt: skip
    moe = p.add_argument_group("experts (qwen3_moe only: refused with a dense architecture)")
    for name, default, what in _TINY_SHAPE:
        flag = "--" + name.replace("_", "-")
        if name in _TINY_MOE:
            moe.add_argument(flag, dest=name, type=int, default=None,
                             help=f"{what} (default {default})")  # fmt: skip
        else:
            p.add_argument(flag, dest=name, type=int, default=default, help=what)
    moe.add_argument(
        "--dense-layers",
        type=_layer_ids,
        default=None,
        metavar="IDS",
        help="comma-separated dense layer ids, e.g. 0 (default: every layer MoE)",
    )
    moe.add_argument(
        "--no-norm-topk-prob",
        dest="norm_topk_prob",
        action="store_false",
        default=None,
        help="the top-k routing weights not renormalized to sum to 1",
    )
    p.add_argument("--tie-embeddings", action="store_true",
                   help="the LM head shares the input embedding's weight")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the checkpoint's weights' dtype")  # fmt: skip
    p.set_defaults(func=_cmd_make_tiny)


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert checkpoints between HF and Megatron")
    csub = p.add_subparsers(dest="direction", required=True)
    a = csub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron dist-checkpoint")
    a.add_argument("--hf", required=True, help="HF checkpoint directory")
    a.add_argument("--out", required=True, help="new directory for the Megatron checkpoint")
    _layout_args(a)
    b = csub.add_parser("megatron-to-hf", help="Megatron checkpoint -> HF safetensors")
    b.add_argument(
        "--megatron",
        required=True,
        help="Megatron checkpoint directory, or a training run's checkpoints/step_N",
    )
    b.add_argument("--out", required=True, help="new directory for the HF checkpoint")
    _layout_args(b)
    c = csub.add_parser("lora-to-hf", help="LoRA run checkpoint -> merged HF model + PEFT adapter")
    c.add_argument("--checkpoint", required=True, help="a LoRA run's checkpoints/step_N")
    c.add_argument("--out", required=True, help="new directory: merged model, PEFT in adapter/")
    c.add_argument("--base", default=None, metavar="PATH",
                   help="the base model, moved since the run (default: base_path in lora.json); "
                   "its files must be the ones the adapters were trained on")  # fmt: skip
    _layout_args(c)
    p.set_defaults(func=_cmd_convert)


def _add_score(sub) -> None:
    p = sub.add_parser("score", help="per-token log-probs of JSONL token sequences")
    p.add_argument(
        "--checkpoint",
        required=True,
        help="HF or Megatron checkpoint directory (a training run's checkpoints/step_N: "
        "export it with convert megatron-to-hf first)",
    )
    p.add_argument("--input", required=True, help='JSONL, one {"input_ids": [...]} per line')
    p.add_argument("--output", required=True, help='JSONL with "logprobs" added')
    p.add_argument("--micro-batch-size", type=int, default=8,
                   help="sequences per forward (memory against speed)")  # fmt: skip
    _layout_args(p)
    p.set_defaults(func=_cmd_score)


def _cmd_train(args) -> None:
    from megatron_gspo.config import load_config
    from megatron_gspo.train.finished import nothing_left

    if args.steps is not None and args.steps < 0:
        raise UserError(f"--steps must be >= 0, not {args.steps}")
    if args.allow_config_change and not args.resume:  # (a new run has no config to differ from)
        raise UserError(ALLOW_WITHOUT_RESUME)
    cfg = load_config(args.config, args.overrides)
    check_steps(args.steps, cfg.train.steps)
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    resume, change = args.resume, args.allow_config_change
    if resume and nothing_left(cfg, run_dir, args.steps, change):
        return  # said, before any server or model starts; exit 0
    # A SIGTERM (a Slurm preemption, `docker stop`; torchrun passes it on to each rank) stops
    # the run as a Ctrl-C does: by an exception (SystemExit(143)), so its servers and workers
    # are stopped on the way out, then the same line; its default action ended the process
    # there and then, without a word, exit -15.
    with terminate_stops():
        try:
            with signals_held():
                from megatron_gspo.train.loop import run  # (megatron, the servers' clients)
                from megatron_gspo.train.parts import build_parts

            with build_parts(cfg, run_dir, resume=resume, allow_config_change=change) as parts:
                run(parts, max_steps=args.steps)
        except (KeyboardInterrupt, SystemExit) as e:  # (servers, workers stopped on the way out)
            signum = _stop_signal(e)
            if signum is None:
                raise
            from megatron_gspo.train.checkpointing import resume_hint

            raise Interrupted(resume_hint(run_dir, resume), signum) from None


def _stop_signal(e: BaseException) -> int | None:
    """The signal that `e` stops a command for (SIGINT: KeyboardInterrupt; SIGTERM: the
    SystemExit(128 + SIGTERM) of `terminate_stops`, or of `outputs.terminate_raises` inside a
    checkpoint's write), None for any other exit."""
    if isinstance(e, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(e, SystemExit) and e.code == 128 + signal.SIGTERM:
        return signal.SIGTERM
    return None


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="run RL (GSPO, GRPO, GRPO+R2/R3) from a YAML config")
    p.add_argument(
        "--config", required=True, help="YAML run config, e.g. configs/tiny_moe_gspo.yaml"
    )
    p.add_argument("--run-dir", default=None, help="metrics, checkpoints, logs (default runs/NAME)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this step, at most train.steps (quick checks)")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue even though the config differs from the run's",
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.set_defaults(func=_cmd_train)


# Model-shape flags of make-task-model: each overrides the task's or the preset's value.
TASK_MODEL_SHAPE = ("layers", "hidden", "experts", "topk", "moe_ffn")


def _cmd_make_task_model(args) -> None:
    with signals_held():
        from megatron_gspo.data.warmstart import make_task_model

    shape = {k: getattr(args, k) for k in TASK_MODEL_SHAPE if getattr(args, k) is not None}
    try:
        make_task_model(args.out, task=args.task, seed=args.seed, preset=args.preset, **shape)
    except FileExistsError as e:
        raise UserError(str(e)) from None
    print(f"wrote {args.out}")


def _add_make_task_model(sub) -> None:
    p = sub.add_parser(
        "make-task-model", help="a tiny MoE fine-tuned to be partly competent on a built-in task"
    )
    p.add_argument("--out", required=True, help="new directory for the HF checkpoint")
    p.add_argument("--task", default=None, help="built-in task (default: the preset's, or arith)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the weights and the fine-tuning batches")  # fmt: skip
    p.add_argument(
        "--preset",
        default=None,
        help="a named model shape with its task: drift (6 MoE layers of 32 small experts, top-4, "
        "on sortlong), drift_long (the same on sortlong20's 40-token answers)",
    )
    g = p.add_argument_group("model shape (default: the preset's, else the task's)")
    for name in TASK_MODEL_SHAPE:
        what = next(w for n, _, w in _TINY_SHAPE if n == name)
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None, help=what)
    p.set_defaults(func=_cmd_make_task_model)


def _add_report(sub) -> None:
    from megatron_gspo.train.report import register

    register(sub)


def _add_study(sub) -> None:
    from megatron_gspo.study import register

    register(sub)


def _add_serve(sub) -> None:
    from megatron_gspo.server.__main__ import serve  # (python -m megatron_gspo.server's: no torch)
    from megatron_gspo.server.args import add_serve_args

    p = sub.add_parser("serve", help="the built-in SGLang-compatible rollout server")
    add_serve_args(p)
    p.set_defaults(func=serve)


def package_version() -> str:
    """The installed package's version (its metadata: no torch imported to say it)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-gspo")
    except metadata.PackageNotFoundError:
        return "(not installed: pip install -e . sets the version)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-gspo", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny(sub)
    _add_convert(sub)
    _add_score(sub)
    _add_serve(sub)
    _add_train(sub)
    _add_make_task_model(sub)
    _add_report(sub)
    _add_study(sub)
    return parser


def parse_args(argv: list[str] | None):
    """Overrides (`key.sub=value`) may sit between or after the flags: argparse stops filling a
    positional list at the first flag, so the rest are collected here."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides"):
        flags = [e for e in extra if e.startswith("-") or "=" not in e]
        if not flags:
            args.overrides = list(args.overrides) + extra
            return args
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> None:
    run_command(lambda: _run(argv))


def _run(argv: list[str] | None) -> None:
    args = parse_args(argv)
    _quiet_known_warnings()
    args.func(args)


def _quiet_known_warnings() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # transformers' own progress bars ("Writing model shards" when make-tiny-model saves): the
    # commands say what they wrote in their own line (read when transformers is imported).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # megatron-core announces at import that optional CUDA extensions are missing; on a CPU run
    # that is expected (model/cpu_compat.py), so keep the console for our own messages.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
    # megatron's distributed optimizer zeroes its fp32 shards' grads through `.grad` of views
    # (its own comment: "throws grad-access warning"); only that call site is silenced.
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf",
                            module=r"megatron\.core\.optimizer\.optimizer")  # fmt: skip
    # torch's deprecations raised at each dist-checkpoint load (convert lora-to-hf, a resume)
    # from megatron-core's torch strategy and from torch's planner it calls: not the user's code.
    mcore_torch = r"megatron\.core\.dist_checkpointing\.strategies\.torch$"
    warnings.filterwarnings(
        "ignore", message=r"`load_state_dict` is deprecated", module=mcore_torch
    )
    planner = r"torch\.distributed\.checkpoint\.(planner_helpers|default_planner)$"
    warnings.filterwarnings("ignore", message=r"Please use DTensor instead", module=planner)


if __name__ == "__main__":
    main()
