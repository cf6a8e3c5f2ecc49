"""Where linear-attention layers read and write their recurrent states in a step, and the
view of the pages that hold them.

A state lives in the page of a block id (shoal/core/kv_cache_spec.py: LinearStateSpec): the
state after a request's tokens [0, p] sits in the block of its state table that covers
token p. A step computing tokens [s, e) of a request reads the state of block (s - 1) //
block_size (the null block, all zeros, for a fresh sequence), writes the state after e - 1
into block (e - 1) // block_size, and, for the prefix cache, the state after every block end
inside the chunk into that block.

Speculative decoding (vLLM's ReplaySSM): a verify step of k + 1 tokens must not leave k
rejected tokens in the states. It reads the state, computes its outputs and writes nothing of
its own: it copies the state it read into every block its tokens reach, and each layer keeps
the tokens' inputs (its conv input and the rest of its projections) in the request's slot
(shoal/layers/linear_replays.py). The next step first folds the accepted run
(ScheduledRequest.replay tokens) into the state of the block it reads from, which is then the
state after the accepted tokens, and goes on as usual. A rejection costs no copy of a state.

CUDA graphs: decode steps read each row's read and write block from a persistent buffer
(StateGraphBuffers); a lone prefill chunk padded to its graph's q tokens reads its real token
count and its block ids (read, a fixed number of block-end saves, write) from another, and
the layers mask the padding out of the states; verify steps, and decode steps that fold a replay, replay the verify
graphs, whose rows of up to q tokens (StateRows) carry every block, count and slot as
device values: each row folds its replay (masked to its count) into the state it read,
runs its tokens, and writes its final state (a row without drafts), or the state before
its tokens into the blocks they reach and its inputs into its slot (a verify row). The fold
is not written back: the row goes on from it, and no later step reads the block it read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shoal.host_to_device import to_device

# The kept-inputs row that padding rows and rows with nothing to keep write
# (shoal/layers/linear_replays.py: requests hold slots 1..capacity).
TRASH_SLOT = 0


@dataclass(frozen=True)
class StateChunk:
    """One request's chunk of a step that is not a lone decode token."""

    start: int  # first row in the step's flattened tokens
    length: int
    offset: int  # absolute position of its first token (tokens computed before it)
    read: int  # block id holding the state before it
    write: int  # block id receiving the state after it
    saves: tuple[int, ...]  # block ids receiving the states at the block ends inside it
    verify: bool = False  # a verify step: outputs only, inputs kept in the request's slot
    slot: int = 0  # (linear_replays.py; 0: the trash slot)
    # read, then saves, then write as one device int64 vector (a view of the step's single
    # copy, so that no layer waits on a host-to-device copy of its own); None: made by the layer
    blocks: torch.Tensor | None = None
    # A prefill graph's chunk: its real token count, a device int64 [1]; the `length` - count
    # tokens after them are padding, which must leave the states alone (None: all are real).
    # Such a chunk starts at a block start (offset 0 stands for any) and `saves` holds
    # placeholders: the real ids, and the trash block for the ends past count, are in blocks.
    count: torch.Tensor | None = None


@dataclass(frozen=True)
class StateFold:
    """Before an eager step: fold each replaying request's accepted run (the first count[i]
    inputs kept in slot[i]) into the state of block[i]. int64 device vectors [R]."""

    block: torch.Tensor
    slot: torch.Tensor
    count: torch.Tensor


@dataclass(frozen=True)
class StateRows:
    """A graph step of R rows of q tokens (padded), every value a device int64 vector [R]
    (reach [M, R]): a row reads the state of `read`, folds the first fold_count inputs kept
    in fold_slot into it, runs its `count` real tokens and writes the state after them into
    `write`. A verify row writes the trash block there, and instead the state before its
    tokens into each block of `reach` (the blocks its tokens reach, the trash block past
    them) and its inputs into slot `keep`; other rows write reach and keep to the trash."""

    q: int
    read: torch.Tensor
    write: torch.Tensor
    count: torch.Tensor
    keep: torch.Tensor
    fold_slot: torch.Tensor
    fold_count: torch.Tensor
    reach: torch.Tensor


@dataclass
class StateMetadata:
    """A step's state slots for the layers of one linear-state group: the decodes (one token
    each, rows [0, num_decodes)) as two index vectors, the other chunks one by one, and the
    replays that come first; or, in a verify graph, its rows (then nothing else is set)."""

    num_decodes: int
    decode_read: torch.Tensor | None  # [Bd] int64 block ids
    decode_write: torch.Tensor | None  # [Bd]
    chunks: list[StateChunk]
    block_size: int
    fold: StateFold | None = None
    rows: StateRows | None = None


@dataclass(frozen=True)
class StateSpecInputs:
    """Per request of a step: the accepted run to replay, whether it verifies drafts, and its
    replay slot (linear_replays.ReplaySlots)."""

    replay: list[int]
    verify: list[bool]
    slots: list[int]


def build_state_metadata(*, query_lens: list[int], context_lens: list[int],
                         block_tables: list[list[int]], block_size: int, num_decodes: int,
                         device: torch.device, null_block: int,
                         save_block_ends: bool = True,
                         spec: StateSpecInputs | None = None) -> StateMetadata:
    """save_block_ends: write the states at block ends inside chunks (prefix caching)."""
    def read(table: list[int], s: int) -> int:
        return table[(s - 1) // block_size] if s else null_block

    fold = None
    if spec is not None and any(spec.replay):
        folds = [(read(t, c), slot, r) for t, c, r, slot in zip(
            block_tables, context_lens, spec.replay, spec.slots) if r]
        fold = StateFold(*(to_device(list(col), torch.long, device) for col in zip(*folds)))

    dr = [read(t, c) for t, c in zip(block_tables[:num_decodes], context_lens)]
    dw = [t[c // block_size] for t, c in zip(block_tables[:num_decodes], context_lens)]
    chunks, start = [], num_decodes
    for i in range(num_decodes, len(query_lens)):
        s, n, table = context_lens[i], query_lens[i], block_tables[i]
        e = s + n
        if spec is not None and spec.verify[i]:  # the state read, into every block reached
            reach = tuple(table[j] for j in range(s // block_size, (e - 1) // block_size + 1))
            chunks.append(StateChunk(start, n, s, read(table, s), -1, reach, True,
                                     spec.slots[i]))
        else:
            saves = tuple(table[j] for j in range(s // block_size, (e - 1) // block_size)
                          ) if save_block_ends else ()
            chunks.append(StateChunk(start, n, s, read(table, s),
                                     table[(e - 1) // block_size], saves))
        start += n
    if chunks:  # every chunk's block ids in one asynchronous copy, shared by the group's layers
        ids = [b for ch in chunks for b in (ch.read, *ch.saves, ch.write)]
        flat = to_device(ids, torch.long, device)
        at, placed = 0, []
        for ch in chunks:
            n = len(ch.saves) + 2
            placed.append(dataclasses.replace(ch, blocks=flat[at:at + n]))
            at += n
        chunks = placed
    return StateMetadata(
        num_decodes,
        to_device(dr, torch.long, device) if num_decodes else None,
        to_device(dw, torch.long, device) if num_decodes else None,
        chunks, block_size, fold)


class StatePages:
    """A linear layer's states inside the pages of one cache tensor [planes, slots, Hk, D]:
    each plane's part of block b is a run of float32 words; a state (conv state, then the
    delta-rule state, flattened) fills plane 0's run, then plane 1's."""

    def __init__(self, cache: torch.Tensor, block_size: int, conv_shape: tuple[int, int],
                 state_shape: tuple[int, int, int]):
        planes = cache.shape[0]
        words = cache.reshape(planes, cache.shape[1] // block_size, -1).view(torch.float32)
        self.conv_shape, self.state_shape = conv_shape, state_shape
        self.conv_words = conv_shape[0] * conv_shape[1]
        total = self.conv_words + state_shape[0] * state_shape[1] * state_shape[2]
        per_plane = words.shape[2]
        if total > planes * per_plane:
            raise ValueError(f"a linear-attention state of {4 * total} bytes does not fit a page "
                             f"of {4 * planes * per_plane}: the block size is too small")
        self.words = words  # [planes, blocks, per_plane] float32
        self.runs: list[tuple[torch.Tensor, int]] = []  # (plane's words [blocks, n], n)
        left = total
        for p in range(planes):
            n = min(left, per_plane)
            if n:
                self.runs.append((words[p, :, :n], n))
            left -= n

    def read(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv states [B, C, K-1] and delta-rule states [B, H, Dk, Dv] of `blocks` [B]
        (float32 copies)."""
        parts = [run.index_select(0, blocks) for run, _ in self.runs]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        b = blocks.shape[0]
        return (flat[:, :self.conv_words].view(b, *self.conv_shape),
                flat[:, self.conv_words:].view(b, *self.state_shape))

    def write(self, blocks: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> None:
        b = blocks.shape[0]
        flat = torch.cat([conv.reshape(b, -1).float(), state.reshape(b, -1).float()], dim=1)
        at = 0
        for run, n in self.runs:
            run.index_copy_(0, blocks, flat[:, at:at + n])
            at += n

    def read_one(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(torch.tensor([block], device=self.runs[0][0].device))

    def write_one(self, block: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.write(torch.tensor([block], device=self.runs[0][0].device), conv[None], state[None])


class StateGraphBuffers:
    """The graph-buffer hooks of AttentionBackend (alloc / fill / graph_metadata) for a
    linear-state group, so decode, verify and lone prefill steps of hybrid models replay as
    CUDA graphs. Decode shapes (q = 1): each row's read and write block in one persistent
    [2, rows] buffer. Verify shapes (q > 1 tokens per row): the StateRows fields, one buffer
    row each. Lone prefill chunks (lone_chunk): [count, read, saves..., write] in a third.
    Padding rows read the null block (zeros) and write `trash_block`, a block no request
    holds, and the trash slot of the kept inputs.

    A prefill graph of q tokens saves the states at the (q - 1) // block_size block ends a
    chunk starting at a block start can hold (prefix caching; none without it), the ones past
    its real tokens into the trash block. A chunk starting inside a block (a later chunk of a
    prompt whose budget is not a multiple of block_size) would move the ends: with prefix
    caching on, it runs eagerly (chunk_fits)."""

    name = "linear-state"
    takes_state_spec = True  # GraphTable.stage passes the step's StateSpecInputs

    def __init__(self, null_block: int, trash_block: int, block_size: int,
                 save_block_ends: bool = False):
        self.null_block, self.trash_block, self.block_size = null_block, trash_block, block_size
        self.save_block_ends = save_block_ends

    def chunk_fits(self, context_len: int) -> bool:
        """Whether a lone chunk after context_len tokens can replay a prefill graph."""
        return not self.save_block_ends or context_len % self.block_size == 0

    def chunk_saves(self, q: int) -> int:
        """The block-end saves of a prefill graph of q tokens."""
        return (q - 1) // self.block_size if self.save_block_ends else 0

    def reach_width(self, q: int) -> int:
        """The most blocks q consecutive tokens reach."""
        return 1 + -(-(q - 1) // self.block_size)

    def alloc_graph_buffers(self, max_rows: int, max_tokens: int, max_blocks: int,
                            device: torch.device, **_: object) -> dict:
        return {"rw": torch.zeros(2, max_rows, dtype=torch.long, device=device),
                "rows": torch.zeros(_ROW_FIELDS + self.reach_width(max_tokens), max_rows,
                                    dtype=torch.long, device=device),
                "chunk": torch.zeros(3 + self.chunk_saves(max_tokens), dtype=torch.long,
                                     device=device),
                "tables": []}

    def fill_graph_buffers(self, buf: dict, rows: int, q: int, context_lens: list[int],
                           block_tables: list[list[int]] | None,
                           slot_mapping: list[int],
                           state_spec: StateSpecInputs | None = None,
                           lone_chunk: bool = False) -> None:
        """slot_mapping: the rows' token slots (-1: padding), which give each row's real
        token count; state_spec: the step's replays, verifies and replay slots; lone_chunk:
        a prefill graph's shape (one row, its last token's logits)."""
        if block_tables is not None:  # (live lists: kept, they follow their requests)
            buf["tables"] = block_tables
        bs, tables = self.block_size, buf["tables"]
        if lone_chunk:
            host = torch.tensor(self._chunk_values(q, context_lens, tables, slot_mapping),
                                dtype=torch.long)
            buf["chunk"][:host.shape[0]].copy_(_staged(host, buf["chunk"]), non_blocking=True)
            return
        n = len(context_lens)
        read = [t[(c - 1) // bs] if c else self.null_block for t, c in zip(tables, context_lens)]
        if q == 1:
            if state_spec is not None and any(state_spec.replay):
                raise ValueError("a decode graph cannot fold replays: they replay verify graphs")
            write = [t[c // bs] for t, c in zip(tables, context_lens)]
            host = torch.tensor([read + [self.null_block] * (rows - n),
                                 write + [self.trash_block] * (rows - n)], dtype=torch.long)
            buf["rw"][:, :rows].copy_(_staged(host, buf["rw"]), non_blocking=True)
            return
        cols = self._row_columns(rows, q, context_lens, tables, slot_mapping, state_spec)
        buf["rows"][:len(cols), :rows].copy_(
            _staged(torch.tensor(cols, dtype=torch.long), buf["rows"]), non_blocking=True)

    def _chunk_values(self, q: int, context_lens: list[int], tables: list[list[int]],
                      slot_mapping: list[int]) -> list[int]:
        """count, read, the chunk_saves(q) block ends' blocks (the trash block past the real
        tokens), write; no real row (capture): nothing read, everything to the trash block."""
        trash, saves = self.trash_block, self.chunk_saves(q)
        if not context_lens:
            return [0, self.null_block] + [trash] * (saves + 1)
        (c,), (t,) = context_lens, tables
        if not self.chunk_fits(c):
            raise ValueError(f"a prefill graph's chunk must start at a block start, got "
                             f"{c} tokens before it (block size {self.block_size})")
        bs, count = self.block_size, sum(s >= 0 for s in slot_mapping[:q])
        read = t[(c - 1) // bs] if c else self.null_block
        ends = [t[c // bs + j - 1] if j * bs < count else trash for j in range(1, saves + 1)]
        return [count, read, *ends, t[(c + count - 1) // bs]]

    def _row_columns(self, rows: int, q: int, context_lens: list[int], tables: list[list[int]],
                     slot_mapping: list[int], spec: StateSpecInputs | None) -> list[list[int]]:
        """Each real row's StateRows values, padded to `rows` (see StateRows)."""
        bs, trash, m = self.block_size, self.trash_block, self.reach_width(q)
        pad = [self.null_block, trash, 0, TRASH_SLOT, TRASH_SLOT, 0] + [trash] * m
        out = []
        for r, (t, c) in enumerate(zip(tables, context_lens)):
            count = sum(s >= 0 for s in slot_mapping[r * q:(r + 1) * q])
            e = c + count
            read = t[(c - 1) // bs] if c else self.null_block
            replay = spec.replay[r] if spec is not None else 0
            slot = spec.slots[r] if spec is not None else TRASH_SLOT
            if spec is not None and spec.verify[r]:
                reach = [t[j] for j in range(c // bs, (e - 1) // bs + 1)]
                out.append([read, trash, count, slot, slot, replay]
                           + reach + [trash] * (m - len(reach)))
            else:
                out.append([read, t[(e - 1) // bs], count, TRASH_SLOT,
                            slot if replay else TRASH_SLOT, replay] + [trash] * m)
        out += [pad] * (rows - len(out))
        return [list(col) for col in zip(*out)]  # one list per field

    def graph_metadata(self, buf: dict, rows: int, q: int,
                       lone_chunk: bool = False) -> StateMetadata:
        if lone_chunk:
            saves = self.chunk_saves(q)
            chunk = buf["chunk"]
            return StateMetadata(0, None, None, [StateChunk(
                0, q, 0, -1, -1, (self.trash_block,) * saves, blocks=chunk[1:saves + 3],
                count=chunk[:1])], self.block_size)
        if q == 1:
            rw = buf["rw"]
            return StateMetadata(rows, rw[0, :rows], rw[1, :rows], [], self.block_size)
        f = buf["rows"][:, :rows]
        m = self.reach_width(q)
        return StateMetadata(0, None, None, [], self.block_size, rows=StateRows(
            q, read=f[0], write=f[1], count=f[2], keep=f[3], fold_slot=f[4], fold_count=f[5],
            reach=f[_ROW_FIELDS:_ROW_FIELDS + m]))

    def advance_graph_buffers(self, buf: dict, rows: int) -> None:
        raise NotImplementedError("linear-attention layers do not draft in graphs")


_ROW_FIELDS = 6  # StateRows' vectors before reach, in the order of its fields


def _staged(host: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """host in pinned memory where dst is on CUDA: an asynchronous copy from pageable memory
    may make the host wait for the step in flight (host_to_device.py)."""
    return host.pin_memory() if dst.is_cuda else host
