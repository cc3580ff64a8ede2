"""Loom samplers (loom.sampler/1, e.g. ``curriculum_sampler``) as PyTorch batch samplers.

``CurriculumSampler`` yields, for each training step, this rank's sample ids of the step's
global batch, as drawn by the plugin: pass it to ``torch.utils.data.DataLoader`` as
``batch_sampler``. It derives from ``torch.utils.data.Sampler`` when torch is installed and
works as a plain iterable otherwise.
"""
from typing import Any, Dict, Iterator, List

from .errors import InvalidArgumentError
from .session import Instance

try:  # torch is optional: the sampler is a plain iterable without it
    from torch.utils.data import Sampler as _Base
except ImportError:  # pragma: no cover - depends on the environment
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["CurriculumSampler"]


class CurriculumSampler(_Base):  # type: ignore[misc,valid-type]
    """A ``loom.sampler/1`` instance as a batch sampler: each item is one step's list of
    sample ids for this rank.

    Every rank draws the same global batch from ``seed`` and the step, and takes its own
    share, so ranks never overlap and exchange nothing. The position (and so the batches to
    come) is the plugin's exported state: :meth:`state_dict` / :meth:`load_state_dict`
    resume exactly.

    Args:
        instance: a sampler instance (``session.instance("sampler", NAME)``); its session
            must stay open.
        dataset_size: samples in the dataset (ids 0 .. dataset_size - 1).
        global_batch: samples per step over all ranks.
        num_steps: steps one pass of ``iter()`` yields, up to and including step
            ``num_steps`` (1-based).
        rank, world_size: this data-parallel rank and the number of ranks.
        seed: the same on every rank and across a resume.

    Attributes:
        step (int): the last step drawn (0 before the first).
        last (dict): what the last step reported: "difficulty" (NaN without a
            curriculum), "epoch", "consumed".
    """

    def __init__(self, instance: Instance, dataset_size: int, global_batch: int,
                 num_steps: int, *, rank: int = 0, world_size: int = 1, seed: int = 0) -> None:
        if not isinstance(instance, Instance) or instance.section != "sampler":
            raise InvalidArgumentError(
                "CurriculumSampler needs a loom.sampler/1 instance (session.instance('sampler', "
                f"NAME)), not {instance!r}")
        if num_steps < 0:
            raise InvalidArgumentError(f"num_steps {num_steps} is negative")
        if not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank {rank} is outside 0 .. world_size - 1 "
                                       f"({world_size - 1})")
        self.instance = instance
        self.dataset_size = int(dataset_size)
        self.global_batch = int(global_batch)
        self.num_steps = int(num_steps)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.capacity = instance.sampler_plan(self.dataset_size, self.global_batch,
                                              self.world_size)
        self.step = 0
        self.last: Dict[str, Any] = {}

    def draw(self, step: int) -> List[int]:
        """This rank's ids for ``step``: the step after :attr:`step`, or the same step again."""
        out = self.instance.sampler_next(step, seed=self.seed, rank=self.rank,
                                         world_size=self.world_size, capacity=self.capacity)
        self.step = step
        self.last = {k: out[k] for k in ("difficulty", "epoch", "consumed")}
        return out["indices"]

    def __iter__(self) -> Iterator[List[int]]:
        while self.step < self.num_steps:
            yield self.draw(self.step + 1)

    def __len__(self) -> int:
        return max(0, self.num_steps - self.step)

    def state_dict(self) -> Dict[str, Any]:
        """The position: the plugin's exported state, the step and the seed."""
        return {"plugin": self.instance.plugin, "state": self.instance.export_state(),
                "step": self.step, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes from :meth:`state_dict`: the next step drawn is the one after the saved
        step, with exactly the ids the uninterrupted run would have drawn."""
        if not isinstance(state, dict) or not isinstance(state.get("state"), (bytes, bytearray)):
            raise InvalidArgumentError("not a CurriculumSampler state dict (no 'state' bytes)")
        if state.get("plugin") != self.instance.plugin:
            raise InvalidArgumentError(f"the state is from plugin '{state.get('plugin')}', this "
                                       f"sampler is plugin '{self.instance.plugin}'")
        if state.get("seed") != self.seed:
            raise InvalidArgumentError(f"the state was drawn with seed {state.get('seed')}, this "
                                       f"sampler has seed {self.seed}")
        self.instance.import_state(bytes(state["state"]))
        # The first plan after an import must give the state's sizes, and restores its
        # position; re-plan now so a mismatch is reported here.
        self.capacity = self.instance.sampler_plan(self.dataset_size, self.global_batch,
                                                   self.world_size)
        self.step = int(state.get("step", 0))
