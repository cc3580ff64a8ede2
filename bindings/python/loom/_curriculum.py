"""The loom.curriculum/1 calls of :class:`loom.Instance` (``curriculum_plan``,
``curriculum_at``, ``curriculum_count``, ``curriculum_score``): difficulty schedules and
difficulty metrics (docs/data.md). A mixin of Instance, kept apart to keep session.py short."""
from __future__ import annotations

import ctypes
import math
from typing import Any, Dict, Optional

from . import _abi
from .errors import InvalidArgumentError, UnimplementedError
from .tensor import Borrowed, borrow

_TOKEN_DTYPES = ("uint16", "int32", "int64")
# loom_curriculum_plan_args.seq_len_mode as curriculum_plan names it
_SEQ_LEN_MODES = {_abi.SEQ_LEN_NONE: "none", _abi.SEQ_LEN_TRUNCATE: "truncate",
                  _abi.SEQ_LEN_RESHAPE: "reshape"}


class CurriculumCalls:
    """Instance methods for ``[curriculum.NAME]`` instances (see :class:`loom.Instance`,
    which provides name, plugin, _require, _table and _call)."""

    def _curriculum(self, fn: str) -> tuple:
        self._require("curriculum")
        obj, table = self._table("curriculum", _abi.CURRICULUM_V1_SIZE, _abi.CurriculumV1)
        if not getattr(table, fn):
            what = {"at": "`at`: it is a metric, not a schedule",
                    "score": "`score`: it is a schedule, not a metric",
                    "count": "`count`: it is a metric that needs no first pass over the "
                             "dataset (stats_count 0), or a schedule"}.get(fn, f"`{fn}`")
            raise UnimplementedError(
                f"curriculum.{self.name} (plugin '{self.plugin}') has no {what}")
        return obj, table

    def curriculum_plan(self, vocab_size: int = 0) -> Dict[str, Any]:
        """What a curriculum instance provides (loom.curriculum/1 ``plan``).

        Args:
            vocab_size: every token of the dataset is below it (metrics that count tokens,
                such as vocabulary_rarity, need it; schedules ignore it).

        Returns:
            dict: {"roles" (the LOOM_CURRICULUM_* bits), "metric" (bool: count and score),
            "schedule" (bool: at), "seq_len_mode" ("none", "truncate" or "reshape"),
            "stats_count" (int64 counters a metric's count fills; 0: no first pass)}.
        """
        obj, table = self._curriculum("plan")
        a = _abi.CurriculumPlanArgs()
        a.struct_size = _abi.CURRICULUM_PLAN_ARGS_SIZE
        a.vocab_size = int(vocab_size)
        self._call(table.plan(obj, ctypes.byref(a)))
        roles = int(a.roles)
        return {"roles": roles, "metric": bool(roles & _abi.CURRICULUM_METRIC),
                "schedule": bool(roles & _abi.CURRICULUM_SCHEDULE),
                "seq_len_mode": _SEQ_LEN_MODES.get(int(a.seq_len_mode), str(a.seq_len_mode)),
                "stats_count": int(a.stats_count)}

    def curriculum_at(self, step: int) -> Dict[str, Any]:
        """A schedule's difficulty at a training step (loom.curriculum/1 ``at``).

        Args:
            step: the training step, 1-based (a step below 1 is an error).

        Returns:
            dict: {"difficulty": float, "seq_len": int (the sequence length of a
            sequence-length schedule, 0 for others)}.
        """
        obj, table = self._curriculum("at")
        a = _abi.CurriculumAtArgs()
        a.struct_size = _abi.CURRICULUM_AT_ARGS_SIZE
        a.step = int(step)
        a.difficulty = math.nan
        self._call(table.at(obj, ctypes.byref(a)))
        return {"difficulty": float(a.difficulty), "seq_len": int(a.seq_len)}

    @staticmethod
    def _samples(tokens: Any, offsets: Any) -> tuple:
        bt = borrow(tokens, "tokens", dtypes=_TOKEN_DTYPES)
        bo = borrow(offsets, "offsets", dtypes=("int64",))
        if len(bt.shape) != 1 or len(bo.shape) != 1 or bo.shape[0] < 1:
            raise InvalidArgumentError(
                f"tokens and offsets are 1-D, offsets with one more element than there are "
                f"samples (sample i is tokens[offsets[i]:offsets[i + 1]]), not "
                f"{list(bt.shape)} and {list(bo.shape)}")
        s = _abi.CurriculumSamples()
        s.struct_size = _abi.CURRICULUM_SAMPLES_SIZE
        s.tokens, s.offsets = bt.pointer, bo.pointer
        return s, bt, bo

    def curriculum_count(self, tokens: Any, offsets: Any, stats: Any, *, vocab_size: int,
                         stream: Optional[int] = None) -> None:
        """Adds the samples' counts to ``stats`` (loom.curriculum/1 ``count``), for a metric
        whose :meth:`curriculum_plan` has ``stats_count`` > 0: sample i is
        ``tokens[offsets[i]:offsets[i + 1]]``. Counts of separate batches (threads, shards,
        ranks) merge by elementwise sum.

        Args:
            tokens: 1-D uint16, int32 or int64 (DLPack), every token below ``vocab_size``.
            offsets: 1-D int64, samples + 1 non-decreasing elements within tokens.
            stats: 1-D int64 of stats_count elements, added to in place.
            vocab_size: as given to :meth:`curriculum_plan`.
            stream: a cudaStream_t (as an int) for CUDA tensors, None for CPU ones.
        """
        obj, table = self._curriculum("count")
        s, bt, bo = self._samples(tokens, offsets)
        bs = borrow(stats, "stats", dtypes=("int64",))
        a = _abi.CurriculumCountArgs()
        a.struct_size = _abi.CURRICULUM_COUNT_ARGS_SIZE
        a.samples = s
        a.vocab_size = int(vocab_size)
        a.stats, a.stream = bs.pointer, stream
        self._call(table.count(obj, ctypes.byref(a)))
        del bt, bo, bs

    def curriculum_score(self, tokens: Any, offsets: Any, scores: Any, *, vocab_size: int,
                         stats: Any = None, stream: Optional[int] = None) -> None:
        """Writes one float64 score per sample (loom.curriculum/1 ``score``): sample i is
        ``tokens[offsets[i]:offsets[i + 1]]``.

        Args:
            tokens, offsets, vocab_size, stream: as for :meth:`curriculum_count`.
            scores: 1-D float64 with one element per sample, written.
            stats: the counts summed over the whole dataset (1-D int64 of stats_count
                elements) for a metric with stats_count > 0; None otherwise.
        """
        obj, table = self._curriculum("score")
        s, bt, bo = self._samples(tokens, offsets)
        bsc = borrow(scores, "scores", dtypes=("float64",))
        if len(bsc.shape) != 1 or bsc.shape[0] != bo.shape[0] - 1:
            raise InvalidArgumentError(
                f"scores must be 1-D with one element per sample ({bo.shape[0] - 1}), not "
                f"{list(bsc.shape)}")
        bst: Optional[Borrowed] = borrow(stats, "stats", dtypes=("int64",)) \
            if stats is not None else None
        a = _abi.CurriculumScoreArgs()
        a.struct_size = _abi.CURRICULUM_SCORE_ARGS_SIZE
        a.samples = s
        a.vocab_size = int(vocab_size)
        a.stats = bst.pointer if bst is not None else None
        a.scores, a.stream = bsc.pointer, stream
        self._call(table.score(obj, ctypes.byref(a)))
        del bt, bo, bsc, bst
