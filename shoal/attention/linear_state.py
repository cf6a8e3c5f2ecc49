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
the tokens' inputs (its conv input and the rest of its projections, by request serial). The
next step first folds the accepted run (ScheduledRequest.replay tokens) into the state of the
block it reads from, which is then the state after the accepted tokens, and goes on as
usual. A rejection costs no copy of a state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.host_to_device import to_device


@dataclass(frozen=True)
class StateChunk:
    """One request's chunk of a step that is not a lone decode token."""

    start: int  # first row in the step's flattened tokens
    length: int
    offset: int  # absolute position of its first token (tokens computed before it)
    read: int  # block id holding the state before it
    write: int  # block id receiving the state after it
    saves: tuple[int, ...]  # block ids receiving the states at the block ends inside it
    verify: bool = False  # a verify step: outputs only, inputs kept by the request's serial
    serial: int = -1


@dataclass(frozen=True)
class StateReplay:
    """Before the step: fold a request's accepted run (the first `tokens` of its last verify,
    kept by its serial) into the state of `block`."""

    block: int
    tokens: int
    serial: int


@dataclass
class StateMetadata:
    """A step's state slots for the layers of one linear-state group: the decodes (one token
    each, rows [0, num_decodes)) as two index vectors, the other chunks one by one, and the
    replays that come first."""

    num_decodes: int
    decode_read: torch.Tensor | None  # [Bd] int64 block ids
    decode_write: torch.Tensor | None  # [Bd]
    chunks: list[StateChunk]
    block_size: int
    replays: list[StateReplay] = field(default_factory=list)


@dataclass(frozen=True)
class StateSpecInputs:
    """Per request of a step: the accepted run to replay, whether it verifies drafts, its
    serial."""

    replay: list[int]
    verify: list[bool]
    serials: list[int]


def build_state_metadata(*, query_lens: list[int], context_lens: list[int],
                         block_tables: list[list[int]], block_size: int, num_decodes: int,
                         device: torch.device, null_block: int,
                         save_block_ends: bool = True,
                         spec: StateSpecInputs | None = None) -> StateMetadata:
    """save_block_ends: write the states at block ends inside chunks (prefix caching)."""
    def read(table: list[int], s: int) -> int:
        return table[(s - 1) // block_size] if s else null_block

    replays: list[StateReplay] = []
    if spec is not None:
        replays = [StateReplay(read(t, c), r, serial) for t, c, r, serial in zip(
            block_tables, context_lens, spec.replay, spec.serials) if r]

    dr = [read(t, c) for t, c in zip(block_tables[:num_decodes], context_lens)]
    dw = [t[c // block_size] for t, c in zip(block_tables[:num_decodes], context_lens)]
    chunks, start = [], num_decodes
    for i in range(num_decodes, len(query_lens)):
        s, n, table = context_lens[i], query_lens[i], block_tables[i]
        e = s + n
        if spec is not None and spec.verify[i]:  # the state read, into every block reached
            reach = tuple(table[j] for j in range(s // block_size, (e - 1) // block_size + 1))
            chunks.append(StateChunk(start, n, s, read(table, s), -1, reach, True,
                                     spec.serials[i]))
        else:
            saves = tuple(table[j] for j in range(s // block_size, (e - 1) // block_size)
                          ) if save_block_ends else ()
            chunks.append(StateChunk(start, n, s, read(table, s),
                                     table[(e - 1) // block_size], saves))
        start += n
    return StateMetadata(
        num_decodes,
        to_device(dr, torch.long, device) if num_decodes else None,
        to_device(dw, torch.long, device) if num_decodes else None,
        chunks, block_size, replays)



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
    linear-state group, so decode steps of hybrid models replay as CUDA graphs: each row's
    read and write block in one persistent [2, rows] buffer. Padding rows read the null block
    (zeros) and write `trash_block`, a block no request holds."""

    name = "linear-state"

    def __init__(self, null_block: int, trash_block: int, block_size: int):
        self.null_block, self.trash_block, self.block_size = null_block, trash_block, block_size

    def alloc_graph_buffers(self, max_rows: int, max_tokens: int, max_blocks: int,
                            device: torch.device, **_: object) -> dict:
        return {"rw": torch.zeros(2, max_rows, dtype=torch.long, device=device),
                "tables": []}

    def fill_graph_buffers(self, buf: dict, rows: int, q: int, context_lens: list[int],
                           block_tables: list[list[int]] | None,
                           slot_mapping: list[int]) -> None:
        if q != 1:
            raise NotImplementedError("linear-attention layers replay decode graphs only")
        if block_tables is not None:  # (live lists: kept, they follow their requests)
            buf["tables"] = block_tables
        bs, tables = self.block_size, buf["tables"]
        pad = rows - len(context_lens)
        read = [t[(c - 1) // bs] if c else self.null_block for t, c in zip(tables, context_lens)]
        write = [t[c // bs] for t, c in zip(tables, context_lens)]
        host = torch.tensor([read + [self.null_block] * pad, write + [self.trash_block] * pad],
                            dtype=torch.long)
        buf["rw"][:, :rows].copy_(host, non_blocking=True)

    def graph_metadata(self, buf: dict, rows: int, q: int) -> StateMetadata:
        rw = buf["rw"]
        return StateMetadata(rows, rw[0, :rows], rw[1, :rows], [], self.block_size)

    def advance_graph_buffers(self, buf: dict, rows: int) -> None:
        raise NotImplementedError("linear-attention layers do not draft in graphs")
