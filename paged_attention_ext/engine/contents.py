"""What each KV block holds, in token ids: a shadow of the cache for the engine's deep check.

The engine records every write (the tokens of a step, at the slots the block manager
gave), copy-on-write copy and swap after the step that made them succeeded. A block's
record is the name of the block before it in its sequence (the prefix it continues)
and the tokens at each of its positions, so a cached block's name can be recomputed
from what was really written there.
"""

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

from ..block_table import NULL_BLOCK, BlockPair, chain_hash


@dataclass
class BlockRecord:
    parent: Optional[bytes]                                   # name of the block before it
    tokens: List[Optional[int]] = field(default_factory=list)  # None: never written
    key: bytes = b""  # what its KV group's names carry (BlockSpaceManager.group_keys)


class BlockContents:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: Dict[int, BlockRecord] = {}
        self.host: Dict[int, BlockRecord] = {}

    def write(self, slots: Sequence[int], tokens: Sequence[int], positions: Iterable[int],
              names: Sequence[bytes], key: bytes = b"") -> None:
        """Tokens of one sequence written at these slots of one KV group; ``names``: the
        sequence's block names, ``key``: the group's."""
        bs = self.block_size
        for slot, token, position in zip(slots, tokens, positions):
            if slot < 0:  # read, not written (a shared prompt block another sequence writes)
                continue
            block, offset = divmod(slot, bs)
            index = position // bs
            parent = names[index - 1] if 0 < index <= len(names) else None
            record = self.device.get(block)
            if offset == 0 or record is None:
                record = self.device[block] = BlockRecord(parent, key=key)
            record.tokens[offset:] = [None] * (offset - len(record.tokens)) + [token]

    def copy(self, copies: Iterable[BlockPair]) -> None:
        for src, dst in copies:
            self.device[dst] = _clone(self.device.get(src))

    def swap_out(self, mapping: Iterable[BlockPair]) -> None:
        for device_block, host_block in mapping:
            self.host[host_block] = _clone(self.device.get(device_block))

    def swap_in(self, mapping: Iterable[BlockPair]) -> None:
        for host_block, device_block in mapping:
            self.device[device_block] = _clone(self.host.get(host_block))

    def tokens(self, pool: Dict[int, BlockRecord], blocks: Sequence[int], length: int) -> List[Optional[int]]:
        """The first ``length`` tokens held by a sequence with these blocks (None where a
        block is freed, :data:`~paged_attention_ext.block_table.NULL_BLOCK`)."""
        bs = self.block_size
        out: List[Optional[int]] = []
        for p in range(length):
            block = blocks[p // bs]
            record = None if block == NULL_BLOCK else pool.get(block)
            held = record.tokens if record is not None else []
            out.append(held[p % bs] if p % bs < len(held) else None)
        return out

    def check_named(self, names: Dict[int, bytes]) -> None:
        """Each named device block holds a full block whose tokens and prefix give its name."""
        for block, name in names.items():
            record = self.device.get(block)
            assert record is not None and len(record.tokens) == self.block_size \
                and None not in record.tokens, f"cached block {block} was never fully written"
            assert chain_hash(record.parent, record.tokens) + record.key == name, (  # type: ignore[arg-type]
                f"cached block {block} holds tokens {record.tokens} after another prefix than "
                "its name says")


def _clone(record: Optional[BlockRecord]) -> BlockRecord:
    if record is None:
        return BlockRecord(None)
    return BlockRecord(record.parent, list(record.tokens), record.key)
