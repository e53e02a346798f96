"""Retention: which checkpoint folders go after a commit, and how their bytes are deleted with no rank doing
O(whole checkpoint) work while the others wait.

    python -m pytest tests/test_ckpt_unit.py tests/test_eval.py -q

The protocol (Committer.sweep_trash, committer.py, runs it on every rank, on the committer thread after each
commit, so no save waits for it):
1. rank 0 picks the doomed folders (`doomed`) and has the storage backend retire each (`apply_retention`): its
   commit marker goes first, then a folder is renamed into <ckpt.dir>/.trash (O(1) on one filesystem); an
   object store, which has no rename, keeps the unmarked objects where they are. A crash at any moment leaves
   an unmarked folder or one in .trash, never a marked partial one; .trash is never listed as a checkpoint.
2. rank 0 lists what the sweep deletes (`list_trash`: .trash, names only; on an object store, the objects under
   the retired prefixes, one paginated listing each) and sends the list to every rank;
3. each rank deletes every W-th file of it (`delete_share`): O(bytes / W) per rank (on S3 in DeleteObjects
   requests of up to 1,000 keys);
4. after a barrier, rank 0 removes what is left: folders, files a rank could not delete (`remove_trash`).
A sweep killed halfway leaves files in .trash (or unmarked prefixes older than the newest checkpoint) for the next
one. How each backend does steps 1-4: ckpt/storage/local.py and s3.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from .layout import COMMIT_FILE, is_marked_committed, list_step_dirs, read_meta
from .storage import storage_for


def doomed(ckpt_dir: str, newest: int, keep_last: int, keep_best: int) -> list[str]:
    """Committed checkpoints beyond keep_last (oldest first) that are not among the keep_best, and dead partial
    folders older than `newest`, the step just committed. Folders of later steps are left alone: they are from
    an earlier run (e.g. skipped as corrupt on resume) and must not push out the checkpoint just made."""
    dirs = [(s, p) for s, p in list_step_dirs(ckpt_dir) if s <= newest]
    committed = [(s, p) for s, p in dirs if is_marked_committed(p)]
    best = best_scored(committed, keep_best)
    out = [(s, p) for s, p in (committed[:-keep_last] if keep_last else []) if s not in best]
    out += [(s, p) for s, p in dirs if s < newest and not is_marked_committed(p)]
    return [p for _, p in sorted(out)]


def apply_retention(ckpt_dir: str, newest: int, keep_last: int, keep_best: int,
                    on_log: Callable[[str], None]) -> list[str]:
    """Retire the `doomed` folders (rank 0, metadata only: the backend's `retire`); returns the paths it took
    away. One that cannot be retired is left to the backend's `retire_failed` (a folder is deleted in place, as
    before .trash existed: correct, but rank 0 alone pays for it), unless its marker could not be removed: a
    marked checkpoint is never deleted file by file."""
    out = []
    for path in doomed(ckpt_dir, newest, keep_last, keep_best):
        store = storage_for(path)
        try:
            store.retire(path, COMMIT_FILE)
        except OSError as e:
            if is_marked_committed(path):
                on_log(f"warning: retention: cannot remove the commit marker of {path} ({e.strerror or e}); kept")
                continue
            store.retire_failed(path, e, on_log)
        out.append(path)
    return out


def clear_stale(path: str, on_log: Callable[[str], None]) -> bool:
    """Get whatever is in the way of this step's save out of it; True if its bytes wait in .trash (the caller
    sweeps it before writing, to free the space). It is not a checkpoint this job trusts: resume verified newer
    ones and skipped it, or it is this job's own failed attempt."""
    return storage_for(path).clear_stale(path, COMMIT_FILE, on_log)


def list_trash(ckpt_dir: str, gone: list[str] = ()) -> list[str] | None:
    """Every file the sweep deletes (full paths), sorted; None when there is nothing to sweep. A folder: all of
    .trash; an object store: every object under the prefixes `gone`."""
    return storage_for(ckpt_dir).sweep_list(ckpt_dir, list(gone))


def delete_share(ckpt_dir: str, files: list[str], rank: int, world_size: int) -> None:
    """Delete this rank's share of `files`: every world_size-th, from `rank`. Never raises (the other ranks wait
    in a barrier after it): a file already gone (an earlier sweep) is fine, one that cannot be deleted is left
    to rank 0's last pass, which says so."""
    with contextlib.suppress(OSError):
        storage_for(ckpt_dir).sweep_share(ckpt_dir, files[rank::world_size])


def remove_trash(ckpt_dir: str, on_log: Callable[[str], None], gone: list[str] = ()) -> None:
    """Rank 0, after every rank deleted its share: whatever is left (.trash; on an object store, under `gone`)."""
    storage_for(ckpt_dir).sweep_finish(ckpt_dir, list(gone), on_log)


def best_scored(checkpoints: list[tuple[int, str]], k: int) -> set[int]:
    """Steps of the k checkpoints with the lowest meta.json `score` (the trainer's eval loss); unscored never count."""
    scored = [(meta["score"], s) for s, p in checkpoints if k and "score" in (meta := read_meta(p, missing_ok=True))]
    return {s for _, s in sorted(scored)[:k]}
