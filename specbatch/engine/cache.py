"""One model's KV cache for a batch of rows; the one place KV caches are rolled back.

Rollback is the same for a chain and a token tree: the columns of rejected tokens become holes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from specbatch.engine.backend import PrefixKV, TargetBackend
from specbatch.engine.hf_cache import append_rows, cache_length, gather_columns, kv_layers, new_cache
from specbatch.engine.loading import LoadedModel


class BatchCache:
    """One model's KV cache for a batch of rows that advance by different amounts.

    Columns are shared by all rows; ``valid[b, j]`` says whether column j holds a token of row b.
    Rejected draft tokens, token-tree branches that lost and left padding are invalid columns
    ("holes") that attention never sees; each row's position ids count only its valid tokens, so
    holes do not shift positions. Tail columns invalid for every row are cropped, and holes are
    squeezed out once they are ``compact_share`` of a cache wider than ``compact_min_cols``.
    Pad queries attend only to themselves so no attention row is empty.
    """

    compact_share = 0.5
    compact_min_cols = 64

    def __init__(self, model: LoadedModel, n_rows: int = 0) -> None:
        self.model = model
        self.cache: Cache = new_cache(grow=not model.compiled_live)
        self.valid = torch.zeros(n_rows, 0, dtype=torch.bool, device=model.device)
        self.n_valid = torch.zeros(n_rows, dtype=torch.long, device=model.device)
        self._block: tuple[int, list[int]] = (0, [])  # last forward: first column, pad per row
        self.last_hidden: torch.Tensor | None = None   # (B, keep, H) when the last forward asked

    @property
    def n_rows(self) -> int:
        return int(self.valid.shape[0])

    def forward(self, feeds: Sequence[Sequence[int]], logits_to_keep: int,
                parents: Sequence[Sequence[int]] | None = None, *, hidden: bool = False) -> torch.Tensor:
        """Append each row's tokens (left-padded to a common width); returns logits (B, keep, V).
        The target backend's surface (engine/backend.py); ``hidden``: keep the final layer's
        states of the same positions in ``last_hidden``.

        ``parents[b][i]``: the feed index of token i's parent in row b's feed, -1 for a token that
        follows the cache directly. None: every feed is a chain (parent of i is i - 1). A token
        sees the row's valid cache columns, its ancestors in the feed and itself; its position id
        is the row's valid length plus its depth in the feed (a tree node: root position + depth).
        """
        dev = self.model.device
        width = max(len(f) for f in feeds)
        n_cols = self.valid.shape[1]
        pads = [width - len(f) for f in feeds]
        inp = torch.tensor([[0] * p + list(f) for p, f in zip(pads, feeds)], dtype=torch.long, device=dev)
        if parents is None and not any(pads) and self._dense():
            # no holes, no pads, chains: the model's own causal mask is the same and cheaper
            new_valid = torch.ones(len(feeds), width, dtype=torch.bool, device=dev)
            pos = self.n_valid[:, None] + torch.arange(width, device=dev)[None, :]
            mask = torch.ones(len(feeds), n_cols + width, dtype=torch.long, device=dev)
        else:
            new_valid, pos, mask = self._block_mask(pads, parents, width)
        extra = {"output_hidden_states": True} if hidden else {}
        out = self.model.forward(inp, self.cache, attention_mask=mask, position_ids=pos,
                                 logits_to_keep=logits_to_keep, **extra)
        self.last_hidden = out.hidden_states[-1][:, -logits_to_keep:] if hidden else None
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.n_valid = self.n_valid + new_valid.sum(dim=1)
        self._block = (n_cols, pads)
        return out.logits

    def _dense(self) -> bool:
        """No holes: every column is valid for every row."""
        return int(self.n_valid.min()) == self.valid.shape[1] if self.n_rows else True

    def _block_mask(self, pads: list[int], parents: Sequence[Sequence[int]] | None, width: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New columns' validity (B, W), position ids (B, W) and the additive mask (B, 1, W, L + W)."""
        new_valid, pos, allowed = block_allowed(self.valid, self.n_valid, pads, parents, width)
        return new_valid, pos, additive(allowed, self.model.model.dtype)[:, None]

    def reject(self, rejected: Sequence[Sequence[int]]) -> None:
        """Row b's feed indices ``rejected[b]`` in the last forward were not accepted: holes."""
        start, pads = self._block
        cols = [(b, start + pads[b] + i) for b, idx in enumerate(rejected) for i in idx]
        if cols:
            self._invalidate(cols)

    def drop_tail(self, n_drop: Sequence[int]) -> None:
        """Row b's last n_drop[b] valid tokens were rejected: holes."""
        if not any(n_drop):
            return
        if len(set(n_drop)) == 1 and self._dense():     # the same tail of every row: a crop
            n = n_drop[0]
            self._crop(self.valid.shape[1] - n)
            self.valid, self.n_valid = self.valid[:, :-n], self.n_valid - n
            return
        cols = []
        for b, n in enumerate(n_drop):
            if n:
                cols += [(b, int(j)) for j in torch.nonzero(self.valid[b]).flatten()[-n:]]
        self._invalidate(cols)

    def _invalidate(self, cols: list[tuple[int, int]]) -> None:
        if cols:
            rows, idx = zip(*cols)
            self.valid[list(rows), list(idx)] = False
            self.n_valid = self.valid.sum(dim=1)
        any_valid = torch.nonzero(self.valid.any(dim=0)).flatten()
        keep = int(any_valid[-1]) + 1 if any_valid.numel() else 0
        if keep < self.valid.shape[1]:
            self._crop(keep)
            self.valid = self.valid[:, :keep]
        cols_now = self.valid.shape[1]
        if cols_now > self.compact_min_cols and self.holes() > self.compact_share:
            self.compact()

    def _crop(self, keep: int) -> None:
        """Forget the cache's columns from ``keep`` on (``valid`` is trimmed by the caller)."""
        length = cache_length(self.cache)
        if keep < length:
            self.cache.crop(keep - length)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows leave the batch); a repeated row is copied."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        if cache_length(self.cache):
            self.cache.batch_select_indices(idx)
        else:   # no columns: nothing to keep, and a cropped cache would keep its old row count
            self.cache = new_cache(grow=not self.model.compiled_live)
        self.valid, self.n_valid = self.valid[idx], self.n_valid[idx]
        self._invalidate([])

    def take(self, rows: list[int]) -> BatchCache:
        """A new cache of copies of these rows, in this order; this one is left as it was."""
        out = type(self)(self.model)
        idx = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        if cache_length(self.cache):
            for i, layer in enumerate(kv_layers(self.cache)):
                out.cache.update(layer.keys.index_select(0, idx), layer.values.index_select(0, idx), i)
        out.valid, out.n_valid = self.valid[idx], self.n_valid[idx]
        return out

    def fork(self, rows: list[int]) -> None:
        """Row i becomes a copy of old row rows[i] (rows may repeat): index_select copies the
        KV of a repeated row, so the copies then advance independently."""
        self.select(rows)

    def extend(self, other: TargetBackend) -> None:
        """Append other's rows (new requests joining), left-padding the shorter cache."""
        assert isinstance(other, BatchCache), "rows join from a backend of the same kind"
        if self.n_rows == 0:
            self.cache, self.valid, self.n_valid = other.cache, other.valid, other.n_valid
            return
        la, lb = self.valid.shape[1], other.valid.shape[1]
        width = max(la, lb)
        if la:             # (joining rows with nothing cached yet, one-token prompts: zeros)
            theirs = kv_layers(other.cache) if lb else [None] * len(kv_layers(self.cache))
            for mine, their in zip(kv_layers(self.cache), theirs, strict=True):
                append_rows(mine, their, other.n_rows)
        elif lb:           # these rows have cached nothing yet: theirs, after rows of zeros
            for their in kv_layers(other.cache):
                their.keys = torch.cat([_zero_rows(their.keys, self.n_rows), their.keys])
                their.values = torch.cat([_zero_rows(their.values, self.n_rows), their.values])
            self.cache = other.cache
        else:   # no columns either side: a cache cropped to none still holds its old rows
            self.cache = new_cache(grow=not self.model.compiled_live)
        self.valid = torch.cat([_left_pad_mask(self.valid, width), _left_pad_mask(other.valid, width)])
        self.n_valid = torch.cat([self.n_valid, other.n_valid])

    def export_prefix(self) -> PrefixKV:
        """This one dense row's KV: per layer (keys, values), each (1, H, L, D)."""
        assert self.n_rows == 1 and self._dense(), "a prefix is one row computed alone"
        # copies: the layers' buffers are views this backend may write into later
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in kv_layers(self.cache)]
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        return PrefixKV(int(self.n_valid[0]), nbytes, layers)

    def load_prefix(self, kv: PrefixKV) -> None:
        """Every row of this fresh backend starts with ``kv``: copied per row, since the
        ``DynamicCache`` keeps one (B, H, L, D) tensor per layer and rows write their own tails."""
        assert not self.valid.shape[1], "a prefix loads into a backend with nothing cached"
        n = self.n_rows
        self.cache = new_cache(grow=not self.model.compiled_live)
        for i, (k, v) in enumerate(kv.data):
            self.cache.update(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), i)   # (a cat: a copy)
        self.valid = torch.ones(n, kv.n_tokens, dtype=torch.bool, device=self.model.device)
        self.n_valid = torch.full((n,), kv.n_tokens, dtype=torch.long, device=self.model.device)

    def holes(self) -> float:
        total = self.valid.numel()
        return 1.0 - float(self.valid.sum()) / total if total else 0.0

    def compact(self) -> None:
        """Squeeze holes out: each row's valid columns, left-padded to the longest row."""
        width = int(self.n_valid.max()) if self.n_rows else 0
        if not width:
            return
        order = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, -width:]
        self._gather(order)
        self.valid = self.valid.gather(1, order)

    def _gather(self, order: torch.Tensor) -> None:
        """Keep, per row b, the cache columns ``order[b]`` (rows, width), in that order."""
        for layer in kv_layers(self.cache):
            gather_columns(layer, order)


def _zero_rows(x: torch.Tensor, n_rows: int) -> torch.Tensor:
    """n_rows rows of zeros shaped like x's rows: (B, H, L, D) -> (n_rows, H, L, D)."""
    return x.new_zeros(n_rows, *x.shape[1:])


def block_allowed(valid: torch.Tensor, n_valid: torch.Tensor, pads: list[int],
                  parents: Sequence[Sequence[int]] | None, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward's block over a cache of ``valid`` (B, L) columns: the new columns' validity
    (B, W), position ids (B, W), and which columns each fed token sees (B, W, L + W): its row's
    valid columns, its ancestors in the feed (chains: the tokens before it) and itself (a pad
    sees only itself, so no attention row is empty)."""
    dev = valid.device
    cols = torch.arange(width, device=dev)
    pad = torch.tensor(pads, device=dev)
    new_valid = cols[None, :] >= pad[:, None]                                   # (B, W)
    if parents is None:
        depth = (cols[None, :] - pad[:, None]).clamp(min=0)                     # (B, W)
        seen = (cols[None, :] <= cols[:, None])[None] & new_valid[:, None, :]   # (B, W, W)
    else:
        depth, seen = _tree_block(parents, pads, width, dev)
    seen[:, cols, cols] = True                                                  # pads see themselves
    allowed = torch.cat([valid[:, None, :].expand(-1, width, -1), seen], dim=2)
    return new_valid, n_valid[:, None] + depth, allowed


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean "may attend" mask as the additive one the model adds to its scores."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _tree_block(parents: Sequence[Sequence[int]], pads: list[int], width: int,
                dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth (B, W) of each fed token and which fed tokens it sees (B, W, W): its ancestors."""
    n = len(parents)
    depth = [[0] * width for _ in range(n)]
    seen = [[[False] * width for _ in range(width)] for _ in range(n)]
    for b, (par, p) in enumerate(zip(parents, pads)):
        for i, a in enumerate(par):
            row = seen[b][p + i]
            if a >= 0:
                depth[b][p + i] = depth[b][p + a] + 1
                row[:] = seen[b][p + a]
            row[p + i] = True
    return (torch.tensor(depth, dtype=torch.long, device=dev),
            torch.tensor(seen, dtype=torch.bool, device=dev))


def _left_pad_mask(valid: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(valid, (width - valid.shape[1], 0), value=False)
