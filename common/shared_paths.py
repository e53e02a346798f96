"""Is a local path one folder on every node? Checked at start, with one small file per node, so that a run.dir on a
node's own disk ends the job in seconds, named, instead of rank 1 waiting forever for rank 0's data cache.

    python -m pytest tests/test_shared_paths.py -q

Every rank calls `unshared_path_problem(paths)` (a collective on the default group); for each path:
1. the first rank of each node (ranks grouped by torchrun's GROUP_RANK, else SLURM_NODEID, else the host name: the
   same under torchrun, srun + torchrun and `accelerate launch`) makes `<path>/.shared-check-<nonce>/` and writes
   `node-<its rank>` there (the nonce, rank 0's, names this check alone);
2. a barrier; then each node's first rank lists that folder (one listing) and looks up by name, one stat each, only
   the tokens the listing lacked (an NFS client may show a listing cached from before the other nodes wrote);
3. one all-gather of what each node saw: every rank composes the same verdict; each first rank deletes its token
   and the folder once it is empty, and, after a barrier, a path it made; a last barrier, so that no rank makes
   that path again (ckpt.dir's lock) before every node has removed it.
Per path: N files for N nodes, N listings, never O(ranks); the two gathers carry a few bytes per rank.
Which paths must be shared and which may be node-local: docs/multinode.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Callable, Iterable

import torch.distributed as dist

from common.words import plural

FIX = "put it on a filesystem every node mounts (NFS, Lustre, GPFS, a cloud file share)"
_MAX_NAMED = 3  # nodes named in the error line; the rest are counted


def node_id() -> str:
    """Which node this process runs on, as its launcher numbers nodes (the host name without one)."""
    return os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or socket.gethostname()


def unseen(expected: Iterable[str], listed: Iterable[str], exists: Callable[[str], bool]) -> list[str]:
    """The names of `expected` that are neither in the listing `listed` nor found by `exists(name)`, a lookup by name
    (asked only for the names the listing lacks)."""
    listed = set(listed)
    return [name for name in expected if name not in listed and not exists(name)]


def unshared_path_problem(paths: dict[str, str], fixes: dict[str, str] | None = None) -> str | None:
    """None if each of `paths` (name, e.g. a config key -> a local folder, made if missing) is one folder on every
    node, else one line naming the first path that is not, the nodes that do not see the others' files there, and
    the fix (FIX, then `fixes[name]` if given). A collective on the default group: every rank calls it with the same
    `paths`; a world of one returns None at once."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, (node_id(), socket.gethostname(), os.urandom(8).hex()))
    nonce = places[0][2]
    leaders = {}  # node -> its first rank
    for r, (node, _, _) in enumerate(places):
        leaders.setdefault(node, r)
    tokens = [f"node-{r}" for r in sorted(leaders.values())]
    me, lead = dist.get_rank(), leaders[places[dist.get_rank()][0]] == dist.get_rank()
    folders = {name: os.path.join(path, f".shared-check-{nonce}") for name, path in paths.items()}
    made = _not_there_yet(paths.values()) if lead else []  # the check leaves no folder behind: a refusal writes nothing
    wrote = {name: _write_token(folder, f"node-{me}") for name, folder in folders.items()} if lead else {}
    dist.barrier()
    seen = {name: (wrote[name] or _missing(folder, tokens)) for name, folder in folders.items()} if lead else None
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, seen)
    if lead:
        for folder in folders.values():
            _remove_token(folder, f"node-{me}")
    dist.barrier()  # every node's token is gone: the folders this check made are empty again
    for folder in made:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    dist.barrier()  # no rank makes one again (ckpt.dir's lock) before every node removed what it made: no later group
    # creation orders it, since gloo's pairs connect lazily (common/dist.py lazy_gloo_pairs)
    for name, path in paths.items():
        problem = _verdict(name, path, views, places, tokens)
        if problem:
            also = [n for n in paths if n != name and _verdict(n, paths[n], views, places, tokens)]
            tail = f"; so are {', '.join(also)}" if also else ""
            return f"{problem}: {FIX}{(fixes or {}).get(name, '')}{tail}"
    return None


def _not_there_yet(paths: Iterable[str]) -> list[str]:
    """The folders of `paths` and their ancestors that do not exist yet, deepest first."""
    missing = set()
    for path in paths:
        path = os.path.abspath(path)
        while not os.path.exists(path):
            missing.add(path)
            path = os.path.dirname(path)
    return sorted(missing, key=lambda p: -p.count(os.sep))


def _write_token(folder: str, token: str) -> str | None:
    """None once `token` is in `folder`, else why it could not be written there (a string, so it is told apart
    from the list of missing tokens a reader returns)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, token), "w") as f:
            f.write(socket.gethostname())
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    return None


def _missing(folder: str, tokens: list[str]) -> list[str] | str:
    try:
        listed = os.listdir(folder)
    except OSError as e:
        return f"cannot list it ({e.strerror or e})"
    return unseen(tokens, listed, lambda t: os.path.exists(os.path.join(folder, t)))


def _remove_token(folder: str, token: str) -> None:
    """This node's token goes; the folder too once empty (the last node to get here removes it)."""
    with contextlib.suppress(OSError):
        os.remove(os.path.join(folder, token))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _verdict(name: str, path: str, views: list, places: list, tokens: list[str]) -> str | None:
    """The problem with `path` as the nodes' first ranks saw it (`views`, by rank), or None. A path no node could
    write to is no sharing problem: the run's own first write there says what is wrong with it."""
    got = {r: view[name] for r, view in enumerate(views) if view is not None}
    failed = {r for r, seen in got.items() if isinstance(seen, str)}
    if len(failed) == len(got):
        return None
    wrote = {f"node-{r}" for r in got if r not in failed}
    blind = [(r, seen if r in failed else [t for t in seen if t in wrote]) for r, seen in got.items()]
    blind = [(r, seen) for r, seen in blind if seen]
    if not blind:
        return None
    named = "; ".join(f"{_node_words(r, places)} {_what_is_wrong(seen)}" for r, seen in blind[:_MAX_NAMED])
    more = f"; and {plural(len(blind) - _MAX_NAMED, 'more node')}" if len(blind) > _MAX_NAMED else ""
    return f"{name}={path} is not one folder on every node ({len(blind)} of {len(tokens)} nodes): {named}{more}"


def _node_words(leader: int, places: list) -> str:
    """'host n2 (ranks 8-15)': the node of rank `leader`, its host and its ranks."""
    node, host, _ = places[leader]
    ranks = [r for r, (n, _, _) in enumerate(places) if n == node]
    span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}" if (
        ranks[-1] - ranks[0] == len(ranks) - 1) else f"ranks {', '.join(map(str, ranks))}"
    return f"host {host} ({span})"


def _what_is_wrong(got: list[str] | str) -> str:
    """Why one node's first rank finds the path unusable: its write failed (a string), or the tokens it missed."""
    if isinstance(got, str):
        return got
    ranks = ", ".join(t.removeprefix("node-") for t in got[:_MAX_NAMED]) + (", ..." if len(got) > _MAX_NAMED else "")
    if len(got) == 1:
        return f"does not see the file the node of rank {ranks} wrote there"
    return f"does not see the files {len(got)} other nodes wrote there (those of ranks {ranks})"
