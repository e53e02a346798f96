"""Retention: which checkpoint folders go after a commit, and how their bytes are deleted with no rank doing
O(whole checkpoint) work while the others wait.

    python -m pytest tests/test_ckpt_unit.py tests/test_eval.py -q

The protocol (Committer.sweep_trash, committer.py, runs it on every rank, on the committer thread after each
commit, so no save waits for it):
1. rank 0 picks the doomed folders (`doomed`) and moves each into <ckpt.dir>/.trash (`move_to_trash`): the
   commit marker is removed first, then the folder is renamed (O(1) on one filesystem). A crash at any
   moment leaves an unmarked folder or one in .trash, never a marked partial one; .trash is never listed
   as a checkpoint.
2. rank 0 lists .trash, names only (`list_trash`), and sends the list to every rank;
3. each rank deletes every W-th file of it (`delete_share`): O(bytes / W) per rank;
4. after a barrier, rank 0 removes what is left: folders, files a rank could not delete (`remove_trash`).
A sweep killed halfway leaves files in .trash for the next one, which lists what is still there.

On an object store (s3://) there is no rename, so no .trash: in step 1 rank 0 deletes each doomed checkpoint's
marker only (`delete_marker`); in step 2 it lists the objects under those prefixes (`list_trash`, one paginated
listing each); each rank deletes its share in DeleteObjects requests of up to 1,000 keys (`delete_share`); rank 0's
last pass deletes what is left under those prefixes (`remove_trash`). A crash after the marker leaves an unmarked
prefix older than the newest checkpoint, which the next sweep dooms like any dead partial save.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Callable

from .commit_protocol import fsync_dir
from .layout import COMMIT_FILE, is_marked_committed, list_step_dirs, read_meta, trash_dir, trash_slot
from .storage import join, scheme_of, storage_for


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
    """Move the `doomed` folders into .trash (rank 0, metadata only); returns the paths it took away. A folder
    that cannot be renamed is deleted here instead, as before .trash existed (correct, but rank 0 alone pays
    for it), unless its marker could not be removed: a marked folder is never deleted file by file."""
    out = []
    for path in doomed(ckpt_dir, newest, keep_last, keep_best):
        try:
            (move_to_trash if scheme_of(path) is None else delete_marker)(path)
        except OSError as e:
            if is_marked_committed(path):
                on_log(f"warning: retention: cannot remove the commit marker of {path} ({e.strerror or e}); kept")
                continue
            if scheme_of(path) is not None:  # a marker already gone: the sweep deletes the objects
                out.append(path)
                continue
            on_log(f"retention: cannot move {path} into .trash ({e.strerror}); deleting it in place")
            shutil.rmtree(path, ignore_errors=True)
        out.append(path)
    return out


def clear_stale(path: str, on_log: Callable[[str], None]) -> bool:
    """Move whatever is in the way of this step's save into .trash; True if it went there (the caller sweeps it
    before writing, to free the space). It is not a checkpoint this job trusts: resume verified newer ones and
    skipped it, or it is this job's own failed attempt. If even the rename fails (a directory without write
    permission cannot change its parent), it is moved aside in place so the save goes on."""
    if scheme_of(path) is not None:
        delete_remote(path)
        on_log(f"checkpoint: deleted {path} (a leftover of an earlier attempt)")
        return False
    try:
        move_to_trash(path)
        on_log(f"checkpoint: moved {path} (a leftover of an earlier attempt) into .trash")
        return True
    except OSError:
        aside = f"{path}.damaged-{os.getpid()}-{int(time.time())}"
        os.replace(path, aside)
        on_log(f"checkpoint: moved damaged {path} aside to {aside}")
        return False


def delete_marker(path: str) -> None:
    """An object-store checkpoint leaves the listing of checkpoints: its marker goes (its objects follow in the
    sweep, every rank a share)."""
    with contextlib.suppress(FileNotFoundError):
        storage_for(path).delete(join(path, COMMIT_FILE))


def delete_remote(path: str) -> None:
    """A leftover in the way of a save on an object store (rare: after a crash): its marker first, then every object
    under it, on rank 0 (a crash in between leaves an unmarked prefix, which a later retention deletes)."""
    delete_marker(path)
    storage_for(path).delete_prefix(path)


def move_to_trash(path: str) -> None:
    """Marker first, made durable, then the rename: no crash leaves a marked folder with files missing. Anything
    may stand where a file or folder belongs (a folder named commit.json, a file named step-N); a folder named
    commit.json is no marker (is_marked_committed wants a file), so it just moves along."""
    marker = os.path.join(path, COMMIT_FILE)
    if os.path.isdir(path) and not os.path.islink(path) and (os.path.islink(marker) or not os.path.isdir(marker)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker)
        with contextlib.suppress(OSError):
            fsync_dir(path)
    os.makedirs(trash_dir(os.path.dirname(os.path.normpath(path))), exist_ok=True)
    os.rename(path, trash_slot(path))


def list_trash(ckpt_dir: str, gone: list[str] = ()) -> list[str] | None:
    """Every file (and link) under .trash, relative to it, sorted; None when there is no .trash. Names only:
    scandir's entry type says file or folder without a stat per file (on Lustre, no metadata-server load
    per file). On an object store: every object under the prefixes `gone` (full paths), None if there are none."""
    if scheme_of(ckpt_dir) is not None:
        store = storage_for(ckpt_dir)
        return [obj for path in gone for obj in store.list_objects(path)] if gone else None
    root = trash_dir(ckpt_dir)
    if not os.path.isdir(root):
        return None
    files, todo = [], [""]
    while todo:
        rel = todo.pop()
        try:
            with os.scandir(os.path.join(root, rel)) as entries:
                for e in entries:
                    (todo if e.is_dir(follow_symlinks=False) else files).append(os.path.join(rel, e.name))
        except OSError:
            continue  # an unreadable folder: rank 0's last pass tries it and says what it could not delete
    return sorted(files)


def delete_share(ckpt_dir: str, files: list[str], rank: int, world_size: int) -> None:
    """Delete this rank's share of `files`: every world_size-th, from `rank`. Never raises (the other ranks wait
    in a barrier after it): a file already gone (an earlier sweep) is fine, one that cannot be deleted is left
    to rank 0's last pass, which says so. On an object store `files` are full paths, deleted in batches."""
    if scheme_of(ckpt_dir) is not None:
        with contextlib.suppress(OSError):
            storage_for(ckpt_dir).delete_many(files[rank::world_size])
        return
    root = trash_dir(ckpt_dir)
    for name in files[rank::world_size]:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(root, name))


def remove_trash(ckpt_dir: str, on_log: Callable[[str], None], gone: list[str] = ()) -> None:
    """Rank 0, after every rank deleted its share: the folders and whatever is left (on an object store: whatever
    is left under the prefixes `gone`)."""
    if scheme_of(ckpt_dir) is not None:
        for path in gone:
            try:
                storage_for(path).delete_prefix(path)
            except OSError as e:
                on_log(f"warning: retention: could not delete everything under {path} ({e}); the next retention "
                       "tries again")
        return
    root = trash_dir(ckpt_dir)
    shutil.rmtree(root, ignore_errors=True)
    if os.path.lexists(root):
        on_log(f"warning: retention: could not delete everything in {root}; delete it by hand to free the space")


def best_scored(checkpoints: list[tuple[int, str]], k: int) -> set[int]:
    """Steps of the k checkpoints with the lowest meta.json `score` (the trainer's eval loss); unscored never count."""
    scored = [(meta["score"], s) for s, p in checkpoints if k and "score" in (meta := read_meta(p, missing_ok=True))]
    return {s for _, s in sorted(scored)[:k]}
