"""Nodes and the files they send each other: which ranks share a node (and its memory folder), the ring of
replicas, and the transfer of whole checkpoint files between ranks over a gloo group, checked on arrival.

    python -m pytest tests/test_memory_replicas.py -q

The layout is torchrun's: the same number of ranks on every node (LOCAL_WORLD_SIZE = L), ranks numbered
node by node, so rank r is on node r // L; its node's first rank (local rank 0) is the node's leader, which
does what is done once per node folder. The ring: with R replicas, rank r's files also go to the rank with
the same local index on each of the next R nodes, ranks r + L, ..., r + R*L (mod W). So every rank sends and
receives R times its own bytes, whatever the world size.

`exchange` moves whole files between ranks, in rounds of one chunk per transfer: every rank posts all its
sends and receives of a round before waiting for any, so no order of ranks can deadlock; while one chunk is
on the wire, the next is read and the last one written (two reused buffers per file). A receiver writes
`<name>.part-<pid>` (over the pages of a file of that name if the step folder has one: replicate.py SPARE),
hashes the bytes as they arrive and renames the file into place only when size and checksum are the
manifest's; a file the sender cannot read is sent as zeros (the receiver's check then fails), so a local
error never leaves a peer waiting in a receive: errors come back as problem lines, and only the network
itself can raise.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..checksum import new_hasher
from ..faults import fault_point
from ..writeback import open_in_place

CHUNK = 16 << 20  # bytes per message; a rank holds two buffers of it per file it sends or receives
_RANK_FILE = re.compile(r"^__(\d+)_")  # DCP names a rank's data files __<rank>_<n>.distcp


def make_step_folder(path: str) -> None:
    """Step folder `path`, and the memory folder above it if missing: this user's alone (0700), wherever it is
    made (a save, or a resume fetching onto a node that has none)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)


def rank_of_file(name: str) -> int | None:
    """The rank that wrote data file `name`; None for .metadata and the small files."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class NodeLayout:
    rank: int
    world_size: int
    ranks_per_node: int

    @classmethod
    def here(cls) -> "NodeLayout":
        """This process's place: from the process group and torchrun's LOCAL_WORLD_SIZE (one node without it:
        every rank counted against this node's memory, never fewer than are there)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        return cls(rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))

    @property
    def regular(self) -> bool:
        """Every node has the same number of ranks (the ring needs it)."""
        return self.ranks_per_node > 0 and self.world_size % self.ranks_per_node == 0

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def leader(self) -> bool:
        return self.rank % self.ranks_per_node == 0

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def ring(self, rank: int, replicas: int) -> list[int]:
        """The ranks that receive a copy of `rank`'s files (the next `replicas` nodes, same local index)."""
        return [(rank + j * self.ranks_per_node) % self.world_size for j in range(1, replicas + 1)]

    def ring_sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose files `rank` receives a copy of."""
        return [(rank - j * self.ranks_per_node) % self.world_size for j in range(1, replicas + 1)]


@dataclass(frozen=True)
class Transfer:
    """File `name` of the step folder goes from rank `src` to rank `dst`; `expected` is its manifest entry
    ({"size", <algorithm>: digest}); `tag` tells it apart from other transfers between the same two ranks."""
    src: int
    dst: int
    name: str
    expected: dict
    tag: int


def _chunks(size: int, chunk: int) -> int:
    return -(-size // chunk)


class _Incoming:
    """One file being received: written under a temporary name, hashed as it arrives. A local write error (a
    full tmpfs) is kept as the problem, and the rest of the file is still received, and dropped: the sender
    must not be left waiting."""

    def __init__(self, folder: str, t: Transfer, algorithm: str, step: int | None):
        self.t, self.algorithm, self.step, self.problem = t, algorithm, step, None
        self.final = os.path.join(folder, t.name)
        self.part = f"{self.final}.part-{os.getpid()}"
        self.hasher, self.size, self.file = new_hasher(algorithm), 0, None
        self._guard(self._open)

    def _open(self) -> None:
        """The part file; where a file of the final name is there already (a memory step made from the spare
        folder, replicate.py), it is renamed to the part file and written over in place."""
        if os.path.isfile(self.final):
            os.replace(self.final, self.part)
        self.file = open_in_place(self.part)

    def _guard(self, write) -> None:
        try:
            write()
        except OSError as e:
            self.problem = self.problem or f"{self.part}: cannot be written ({e.strerror or e})"
            if self.file is not None:
                self.file.close()

    def write(self, buf: torch.Tensor) -> None:
        data = buf.numpy()
        if self.problem is None:
            self._guard(lambda: (self.file.write(data), self.file.flush()))
        self.hasher.update(data)
        self.size += len(data)
        fault_point("partial_replica", self.step)  # tests: a kill leaves a torn .part file, never a named one

    def finish(self) -> str | None:
        """Rename into place if written whole with the manifest's size and checksum; else the problem."""
        if self.problem is None:
            self._guard(lambda: (self.file.truncate(self.size), os.fsync(self.file.fileno()), self.file.close()))
        if self.problem is None and (self.size != self.t.expected["size"]
                                     or self.hasher.hexdigest() != self.t.expected[self.algorithm]):
            self.problem = f"{self.t.name} from rank {self.t.src}: checksum mismatch on arrival ({self.algorithm})"
        if self.problem is None:
            self._guard(lambda: os.replace(self.part, self.final))
        if self.problem is not None:
            with contextlib.suppress(OSError):
                os.remove(self.part)
        return self.problem


def _slot(bufs: list[torch.Tensor], size: int, chunk: int, k: int) -> torch.Tensor | None:
    """Chunk `k` of a file of `size` bytes, in the buffer it alternates to (None past its end)."""
    n = min(chunk, size - k * chunk)
    return bufs[k % 2][:n] if n > 0 else None


def _buffers(size: int, chunk: int) -> list[torch.Tensor]:
    """Two reused buffers: one chunk on the wire while the other is read from or written to the file."""
    return [torch.empty(min(chunk, size), dtype=torch.uint8) for _ in range(2)]


class _Outgoing:
    """One file being sent, read chunk by chunk straight into the buffers; zeros where it cannot be read
    (missing, short): the receiver's check then fails, and nobody waits."""

    def __init__(self, folder: str, t: Transfer, chunk: int, problems: list[str]):
        self.t, self.chunk, self.file, self.bufs = t, chunk, None, _buffers(t.expected["size"], chunk)
        try:
            self.file = open(os.path.join(folder, t.name), "rb")
        except OSError as e:
            problems.append(f"{os.path.join(folder, t.name)}: cannot be read to send to rank {t.dst} "
                            f"({e.strerror or e})")

    def chunk_at(self, k: int) -> torch.Tensor | None:
        return _slot(self.bufs, self.t.expected["size"], self.chunk, k)

    def read(self, k: int) -> None:
        """Chunk `k` (the file is read in order) into its buffer."""
        view, got = self.chunk_at(k), 0
        if view is None:
            return
        with contextlib.suppress(OSError):
            while self.file is not None and got < len(view) and (n := self.file.readinto(memoryview(view.numpy())[got:])):
                got += n
        view[got:] = 0


def exchange(transfers: list[Transfer], rank: int, pg, src_dir: str, dst_dir: str, algorithm: str,
             step: int | None = None, chunk: int = CHUNK) -> list[str]:
    """Every rank named in `transfers` calls this with the transfers it takes part in (the same list on both ends
    of each): sends its files from `src_dir`, receives into `dst_dir` (made if missing), each file checked
    against its manifest entry. Returns this rank's problems; raises only if the network fails."""
    sending = [t for t in transfers if t.src == rank]
    receiving = [t for t in transfers if t.dst == rank]
    problems: list[str] = []
    if receiving:
        with contextlib.suppress(OSError):  # if it cannot be made, each file says so (_Incoming)
            make_step_folder(dst_dir)
    outgoing = [_Outgoing(src_dir, t, chunk, problems) for t in sending]
    incoming = [(_Incoming(dst_dir, t, algorithm, step), _buffers(t.expected["size"], chunk)) for t in receiving]
    try:
        rounds, pending = max([_chunks(t.expected["size"], chunk) for t in sending + receiving], default=0), []
        for out in outgoing:
            out.read(0)
        for k in range(rounds):  # chunk k on the wire while chunk k - 1 is written and chunk k + 1 read
            works, arriving = [], []
            for out in outgoing:
                if (view := out.chunk_at(k)) is not None:
                    works.append(dist.isend(view, out.t.dst, group=pg, tag=out.t.tag))
            for inc, bufs in incoming:
                if (view := _slot(bufs, inc.t.expected["size"], chunk, k)) is not None:
                    works.append(dist.irecv(view, inc.t.src, group=pg, tag=inc.t.tag))
                    arriving.append((inc, view))
            for inc, view in pending:
                inc.write(view)
            for out in outgoing:
                out.read(k + 1)
            for work in works:
                work.wait()
            pending = arriving
        for inc, view in pending:
            inc.write(view)
        problems += [p for p in (inc.finish() for inc, _ in incoming) if p]
    finally:
        for f in [*(out.file for out in outgoing), *(inc.file for inc, _ in incoming)]:
            if f is not None and not f.closed:
                f.close()
    return problems
