"""Command line for checkpoints: verify, inspect, reshard, export.

    python -m ckpt verify  runs/tiny/checkpoints/step-000200 [--jobs 8]
    python -m ckpt inspect runs/tiny/checkpoints                  # list: step, world size, size, status
    python -m ckpt inspect runs/tiny/checkpoints/step-000200      # summary: train state, sizes by group
    python -m ckpt inspect runs/tiny/checkpoints/step-000200 --tensors   # every key, shape and dtype
    python -m ckpt reshard <src> <dst> --world-size 3
    python -m ckpt export  <checkpoint> <out_dir> [--dtype auto|fp32|bf16|fp16] [--jobs 4]
    python -m ckpt export  <checkpoint> <out_dir> --adapter            # LoRA: PEFT adapter folder (default: merged)

Every path may be a local folder, s3://bucket/prefix (credentials and endpoint: the AWS_* variables, e.g.
AWS_ENDPOINT_URL) or az://container/prefix (AZURE_STORAGE_CONNECTION_STRING). Exit status 0 on success, 1 when
a checkpoint is invalid or a command fails, 2 for bad input (a path that is no checkpoint, bad arguments, storage
out of reach or refusing access, an object store that does not enforce create-only writes and compare-and-swap);
errors go to stderr. `verify` and `reshard` prove those two guarantees on the store they verify or write a marker
on, as a run does (`--unchecked-store`: go on at one's own risk, with one warning line); `inspect` and `export`
write no marker and do not ask.
"""

from __future__ import annotations

import argparse
import sys

from common.versions import unsupported_versions
from common.words import plural
from .commit_protocol import VerifyError, verify_checkpoint
from .describe import inspect_path
from .hf.export import export_cli
from .layout import COMMIT_FILE, META_FILE, list_step_dirs
from .reshard import reshard
from .storage import storage_for, unsupported
from .storage.base import GuaranteeError

UNCHECKED_HELP = "go on (one warning line) on an object store that ignores create-only writes or compare-and-swap"


def not_a_checkpoint(path: str, cmd: str = "verify") -> str | None:
    """Why `path` is no checkpoint folder at all (rather than a damaged or uncommitted one), or None."""
    store = storage_for(path)
    if store.has_folders and not store.is_folder(path):
        return f"{path}: no such folder"
    names = set(store.listdir(path))
    if names & {COMMIT_FILE, META_FILE, ".metadata"}:
        return None  # a checkpoint, committed or not: verify says what is wrong with it
    steps = [p for _, p in list_step_dirs(path)]
    if steps:
        return (f"{path} is a checkpoints folder ({plural(len(steps), 'step-* folder')}), not a checkpoint: {cmd} one "
                f"of them, e.g. the newest: python -m ckpt {cmd} {steps[-1]}")
    if not names and not store.has_folders:  # an object store's empty prefix (an empty folder: below)
        return f"{path}: {store.missing}"
    return f"{path} is not a checkpoint folder (no {COMMIT_FILE}, {META_FILE} or .metadata in it)"


def no_checkpoint_error(path: str, cmd: str) -> bool:
    """Print one error line and say True when `path` is no checkpoint at all (bad input, exit status 2)."""
    try:
        problem = not_a_checkpoint(path, cmd)
    except OSError as e:  # an object store that cannot be reached, or refuses the credentials
        problem = f"cannot read {path}: {e}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
    return problem is not None


def unkept_guarantees(path: str, unchecked: bool, reads_only: bool = False) -> bool:
    """Print one error line and say True when the store of `path`, whose marker a command trusts or writes, does not
    enforce create-only writes and compare-and-swap (`unchecked`, --unchecked-store: one warning line, False).
    `reads_only` (verify): credentials that may only read cannot write the probe; that is one warning line, not a
    refusal, since verifying writes nothing."""
    try:
        storage_for(path).check_guarantees(path, unchecked, "--unchecked-store",
                                           lambda line: print(line, file=sys.stderr))
    except GuaranteeError as e:
        print(f"error: {e}", file=sys.stderr)
        return True
    except PermissionError as e:
        if not reads_only:
            raise
        print(f"warning: could not check the store's create-only writes and compare-and-swap at {path} (no write "
              f"access: {e}); verifying the checkpoint's bytes only", file=sys.stderr)
    return False


def cmd_verify(args) -> int:
    if no_checkpoint_error(args.path, "verify") or unkept_guarantees(args.path, args.unchecked_store, reads_only=True):
        return 2
    try:
        marker = verify_checkpoint(args.path, jobs=args.jobs)
    except VerifyError as e:
        print(f"INVALID: {e}", file=sys.stderr)
        return 1
    size = sum(f["size"] for f in marker["files"].values())
    print(f"OK: {args.path}: step {marker['step']}, {len(marker['files'])} files, {size / 2**20:.1f} MiB, "
          f"sizes and {marker['algorithm']} checksums match the commit manifest")
    return 0


def cmd_inspect(args) -> int:
    return inspect_path(args.path, world_size=args.world_size, tensors=args.tensors)


def cmd_reshard(args) -> int:
    if no_checkpoint_error(args.src, "reshard"):  # a missing source is bad input (2); a damaged one fails verification (1)
        return 2
    if unkept_guarantees(args.dst, args.unchecked_store):  # the store the new marker goes to
        return 2
    return reshard(args.src, args.dst, args.world_size)


def cmd_export(args) -> int:
    return export_cli(args.checkpoint, args.out_dir, args.dtype, args.max_shard_size, args.jobs, args.adapter)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ckpt", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check commit marker, manifest, sizes and checksums")
    v.add_argument("path", help="one checkpoint folder, e.g. runs/tiny/checkpoints/step-000200")
    v.add_argument("--jobs", type=int, default=1, help="threads hashing files in parallel")
    v.add_argument("--unchecked-store", action="store_true", help=UNCHECKED_HELP)
    v.set_defaults(fn=cmd_verify)
    i = sub.add_parser("inspect", help="list checkpoints of a directory, or show one checkpoint")
    i.add_argument("path", help="a ckpt.dir (lists its checkpoints) or one step-NNNNNN checkpoint folder")
    i.add_argument("--world-size", type=int, default=None, help="dry run: can this checkpoint resume at W ranks?")
    i.add_argument("--tensors", action="store_true", help="list every key with its shape and dtype")
    i.set_defaults(fn=cmd_inspect)
    r = sub.add_parser("reshard", help="rewrite a checkpoint as if saved by W ranks")
    r.add_argument("src", help="the checkpoint folder to read (step-NNNNNN)")
    r.add_argument("dst", help="the new checkpoint folder to write (must not exist)")
    r.add_argument("--world-size", type=int, required=True, help="the number of ranks the new checkpoint is saved as")
    r.add_argument("--unchecked-store", action="store_true", help=UNCHECKED_HELP)
    r.set_defaults(fn=cmd_reshard)
    e = sub.add_parser("export", help="write a Hugging Face model folder from a checkpoint")
    e.add_argument("checkpoint", help="the checkpoint folder to export (step-NNNNNN)")
    e.add_argument("out_dir", help="the Hugging Face model folder to write")
    e.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="auto: the source model's torch_dtype (fp32 for a random init)")
    e.add_argument("--jobs", type=int, default=1, help="processes writing tensors in parallel")
    e.add_argument("--max-shard-size", default="2GB", help="split safetensors above this size (e.g. 500MB)")
    e.add_argument("--adapter", action="store_true",
                   help="LoRA checkpoint: write the PEFT adapter folder (PeftModel.from_pretrained) instead of merging")
    e.set_defaults(fn=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    named = {name: getattr(args, name) for name in ("path", "src", "dst", "checkpoint", "out_dir") if hasattr(args, name)}
    paths = list(named.values())
    problems = [unsupported_versions()] + [unsupported(path, name.replace("_", "-")) for name, path in named.items()]
    for problem in problems:  # the torch/transformers releases, then each path: local or a store's URL
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    try:
        return args.fn(args)
    except OSError as e:  # storage out of reach, access denied, no such bucket: bad input, one line
        print(f"error: python -m ckpt {args.cmd} {' '.join(paths)}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
