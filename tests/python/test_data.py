"""loom.data.CurriculumSampler over the curriculum_sampler plugin (single_cluster: an
epoch-shuffled sampler): rank shares, passes, exact resume, errors."""
import pytest

import loom
from loom.data import CurriculumSampler

SHUFFLE = '[sampler.data]\nplugin = "curriculum_sampler"\nclustering_type = "single_cluster"\n'


@pytest.fixture
def session():
    try:
        s = loom.Session.from_string(SHUFFLE, "data.toml", log_level="error")
    except loom.NotFoundError as e:
        pytest.skip(f"curriculum_sampler is not built: {e}")
    with s:
        yield s


def _sampler(session, **kw):
    args = dict(dataset_size=100, global_batch=8, num_steps=25, world_size=2, seed=11)
    args.update(kw)
    return CurriculumSampler(session.instance("sampler", "data"), **args)


def test_ranks_share_each_global_batch_and_a_pass_has_no_repeats():
    with loom.Session.from_string(SHUFFLE, log_level="error") as s0, \
            loom.Session.from_string(SHUFFLE, log_level="error") as s1:
        r0 = list(_sampler(s0, rank=0))
        r1 = list(_sampler(s1, rank=1))
    assert len(r0) == len(r1) == 25
    assert all(len(b) == 4 for b in r0 + r1)
    first_pass = [i for a, b in zip(r0[:12], r1[:12]) for i in a + b]  # 96 of the 100
    assert len(set(first_pass)) == 96 and all(0 <= i < 100 for i in first_pass)
    # Later passes repeat the same samples in a new order.
    second_pass = [i for a, b in zip(r0[13:25], r1[13:25]) for i in a + b]
    assert len(set(second_pass)) == 96 and second_pass != first_pass


def test_the_same_seed_draws_the_same_batches_and_another_does_not(session):
    a = list(_sampler(session))
    with loom.Session.from_string(SHUFFLE, log_level="error") as s:
        b = list(_sampler(s))
    with loom.Session.from_string(SHUFFLE, log_level="error") as s:
        c = list(_sampler(s, seed=12))
    assert a == b and a != c


def test_resume_is_exact(session):
    full = list(_sampler(session))
    with loom.Session.from_string(SHUFFLE, log_level="error") as s:
        first = _sampler(s)
        head = [first.draw(step) for step in range(1, 11)]
        saved = first.state_dict()
    assert head == full[:10]
    with loom.Session.from_string(SHUFFLE, log_level="error") as s:
        resumed = _sampler(s)
        resumed.load_state_dict(saved)
        assert resumed.step == 10 and len(resumed) == 15
        assert list(resumed) == full[10:]
        assert resumed.last["consumed"] == 25 * 8 and resumed.last["epoch"] == 1


def test_errors(session):
    s = _sampler(session)
    s.draw(1)
    with pytest.raises(loom.FailedPreconditionError, match="not the next step"):
        s.draw(5)
    with pytest.raises(loom.InvalidArgumentError, match="seed"):
        _sampler(session, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(loom.InvalidArgumentError, match="rank 2"):
        _sampler(session, rank=2)
    with loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n') as o:
        with pytest.raises(loom.InvalidArgumentError, match="loom.sampler/1 instance"):
            CurriculumSampler(o.optimizer(), 10, 2, 3)
    with pytest.raises(loom.LoomError, match="global_batch"):
        _sampler(session, global_batch=1)  # fewer samples than ranks


def test_as_a_dataloader_batch_sampler(session):
    torch = pytest.importorskip("torch")
    data = torch.arange(100) * 10
    loader = torch.utils.data.DataLoader(data, batch_sampler=_sampler(session, num_steps=3))
    batches = [b.tolist() for b in loader]
    assert len(batches) == 3 and all(len(b) == 4 and all(v % 10 == 0 for v in b) for b in batches)
