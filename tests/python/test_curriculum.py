"""loom.curriculum/1 from Python (Instance.curriculum_plan / _at / _count / _score): the
bundled schedules against docs/data.md's formulas, step by step, and the bundled metrics
against their definitions on small token arrays."""
import json
import math
import os

import pytest

import loom

np = pytest.importorskip("numpy")


def open_session(text):
    return loom.Session.from_string(text, "<test_curriculum>", log_level="error")


def root_schedule(s, lo, hi, total, q, k=1.0):
    """docs/data.md, "Schedules": fixed_linear (k = 1) and fixed_root at step s."""
    if s >= total:
        return float(hi)
    v = (s / total) ** (1.0 / k)
    d = math.floor(v * (hi - lo) + lo)
    d = d - (d % q)
    return float(max(min(d, hi), lo))


def discrete_schedule(s, difficulty, max_step):
    """docs/data.md: difficulty[i] for the first i with s <= max_step[i], the last entry
    after the last max_step; once the largest listed difficulty is reached, it stays."""
    top = max(difficulty)
    for i, d in enumerate(difficulty):
        if d == top:  # this stage has been reached (s is past every earlier max_step)
            return float(top)
        if i < len(max_step) and s <= max_step[i]:
            return float(d)
    return float(difficulty[-1])


STEPS = [1, 2, 3, 7, 8, 9, 10, 11, 50, 99, 100, 101, 999, 1000, 1001, 10000, 27500, 55000,
         109999, 110000, 110001, 250000]


@pytest.mark.parametrize("lo,hi,q", [(80, 2048, 8), (1, 100, 1), (3, 50, 4), (0.5, 7.25, 1)])
def test_fixed_linear_follows_the_formula(lo, hi, q):
    total = 110000
    with open_session(f'[curriculum.s]\nplugin = "fixed_linear"\nmin_difficulty = {lo}\n'
                      f'max_difficulty = {hi}\ntotal_curriculum_step = {total}\n'
                      f'difficulty_step = {q}\n') as s:
        inst = s.instance("curriculum", "s")
        plan = inst.curriculum_plan()
        assert plan["schedule"] and not plan["metric"]
        assert (plan["seq_len_mode"], plan["stats_count"]) == ("none", 0)
        for step in STEPS:
            got = inst.curriculum_at(step)
            assert got == {"difficulty": root_schedule(step, lo, hi, total, q),
                           "seq_len": 0}, step


@pytest.mark.parametrize("k", [2, 3, 0.5])
def test_fixed_root_follows_the_formula(k):
    total = 110000
    with open_session(f'[curriculum.s]\nplugin = "fixed_root"\nmin_difficulty = 1\n'
                      f'max_difficulty = 100\ntotal_curriculum_step = {total}\n'
                      f'difficulty_step = 1\nroot_degree = {k}\n') as s:
        inst = s.instance("curriculum", "s")
        for step in STEPS:
            assert inst.curriculum_at(step)["difficulty"] == \
                root_schedule(step, 1, 100, total, 1, k), step


def test_the_worked_values_of_docs_data_md():
    with open_session('[curriculum.voc]\nplugin = "fixed_root"\nmin_difficulty = 1\n'
                      'max_difficulty = 100\ntotal_curriculum_step = 110000\n'
                      'difficulty_step = 1\nroot_degree = 2\n'
                      '[curriculum.slw]\nplugin = "seqlen_warmup"\nmin_difficulty = 80\n'
                      'max_difficulty = 2048\ntotal_curriculum_step = 110000\n') as s:
        voc, slw = s.instance("curriculum", "voc"), s.instance("curriculum", "slw")
        steps = [1, 1000, 10000, 27500, 55000, 110000]
        assert [voc.curriculum_at(t)["difficulty"] for t in steps] == [1, 10, 30, 50, 71, 100]
        assert [slw.curriculum_at(t)["seq_len"] for t in steps] == \
            [80, 96, 256, 568, 1064, 2048]


def test_fixed_discrete_follows_the_formula():
    difficulty, max_step = [1, 2, 3, 4, 5], [2, 4, 6, 8]
    with open_session('[curriculum.s]\nplugin = "fixed_discrete"\n'
                      f'difficulty = {difficulty}\nmax_step = {max_step}\n'
                      '[curriculum.dip]\nplugin = "fixed_discrete"\n'
                      'difficulty = [1, 6, 2, 3]\nmax_step = [3, 5, 9]\n') as s:
        inst, dip = s.instance("curriculum", "s"), s.instance("curriculum", "dip")
        for step in range(1, 14):
            assert inst.curriculum_at(step)["difficulty"] == \
                discrete_schedule(step, difficulty, max_step), step
            # Frozen at the largest difficulty once reached: 6 stays over the 2 and 3 listed
            # for steps 6 on.
            assert dip.curriculum_at(step)["difficulty"] == \
                discrete_schedule(step, [1, 6, 2, 3], [3, 5, 9]), step
        assert [dip.curriculum_at(t)["difficulty"] for t in (3, 4, 6, 9, 10)] == [1, 6, 6, 6, 6]


@pytest.mark.parametrize("stype,k,mode", [("fixed_linear", 1, "truncate"),
                                          ("fixed_root", 2, "reshape")])
def test_seqlen_warmup_gives_the_length(stype, k, mode):
    extra = f"root_degree = {k}\n" if stype == "fixed_root" else ""
    with open_session(f'[curriculum.slw]\nplugin = "seqlen_warmup"\nmode = "{mode}"\n'
                      f'schedule_type = "{stype}"\nmin_difficulty = 64\nmax_difficulty = 1000\n'
                      f'total_curriculum_step = 5000\n{extra}') as s:
        inst = s.instance("curriculum", "slw")
        assert inst.curriculum_plan()["seq_len_mode"] == mode
        for step in [1, 2, 10, 100, 1234, 4999, 5000, 9000]:
            want = root_schedule(step, 64, 1000, 5000, 8, k)  # difficulty_step 8 by default
            assert inst.curriculum_at(step) == {"difficulty": want, "seq_len": int(want)}, step


def rarity_reference(tokens, offsets, vocab):
    """docs/data.md: c(t) the dataset's count of t (1 when 0), C the sum of c over the
    vocabulary, a sample's score the sum of -log(c(t) / C) over its tokens."""
    c = np.bincount(tokens, minlength=vocab).astype(np.int64)
    adj = np.where(c == 0, 1, c).astype(np.float64)
    nlp = -np.log(adj / adj.sum())
    return c, [float(nlp[tokens[a:b]].sum()) for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.mark.parametrize("dtype", ["uint16", "int32", "int64"])
def test_vocabulary_rarity_counts_and_scores_a_token_array(dtype):
    vocab = 50
    rng = np.random.default_rng(5)
    tokens = rng.zipf(1.5, size=300).clip(max=vocab - 1).astype(dtype)  # skewed: some rare
    offsets = np.array([0, 7, 7, 40, 41, 128, 300], dtype=np.int64)  # an empty sample too
    with open_session('[curriculum.voc]\nplugin = "vocabulary_rarity"\n') as s:
        voc = s.instance("curriculum", "voc")
        plan = voc.curriculum_plan(vocab)
        assert plan["metric"] and not plan["schedule"]
        assert (plan["stats_count"], plan["seq_len_mode"]) == (vocab, "none")
        # count in two shards, merged by sum, as the analyzer does
        stats = np.zeros(vocab, dtype=np.int64)
        voc.curriculum_count(tokens, offsets[:4], stats, vocab_size=vocab)
        second = np.zeros(vocab, dtype=np.int64)
        voc.curriculum_count(tokens, offsets[3:], second, vocab_size=vocab)
        stats += second
        counts, want = rarity_reference(tokens.astype(np.int64), offsets, vocab)
        assert np.array_equal(stats, counts)
        scores = np.full(len(offsets) - 1, np.nan)
        voc.curriculum_score(tokens, offsets, scores, vocab_size=vocab, stats=stats)
        lengths = np.diff(offsets)
        for i, (got, ref) in enumerate(zip(scores, want)):
            # a fixed-point sum: each token within 2^-33 of -log p(t), the score a multiple
            # of 2^-32 (docs/data.md)
            assert abs(got - ref) <= lengths[i] * 2.0 ** -33 + 1e-12, i
            assert float(got * 2.0 ** 32).is_integer(), i
        assert scores[1] == 0.0  # the empty sample


def test_seqlen_metric_counts_tokens_that_are_not_padding():
    tokens = np.array([5, 0, 0, 3, 4, 0, 9, 9], dtype=np.int32)
    offsets = np.array([0, 3, 6, 8], dtype=np.int64)
    with open_session('[curriculum.len]\nplugin = "seqlen"\n'
                      '[curriculum.nopad]\nplugin = "seqlen"\npad_token = 0\n') as s:
        plain, nopad = s.instance("curriculum", "len"), s.instance("curriculum", "nopad")
        assert plain.curriculum_plan(16)["stats_count"] == 0
        scores = np.zeros(3)
        plain.curriculum_score(tokens, offsets, scores, vocab_size=16)
        assert scores.tolist() == [3.0, 3.0, 2.0]
        nopad.curriculum_score(tokens, offsets, scores, vocab_size=16)
        assert scores.tolist() == [1.0, 2.0, 2.0]


def test_torch_tensors_work_too():
    torch = pytest.importorskip("torch")
    tokens = torch.tensor([1, 2, 2, 3], dtype=torch.int64)
    offsets = torch.tensor([0, 1, 4], dtype=torch.int64)
    with open_session('[curriculum.voc]\nplugin = "vocabulary_rarity"\n') as s:
        voc = s.instance("curriculum", "voc")
        stats = torch.zeros(4, dtype=torch.int64)
        voc.curriculum_count(tokens, offsets, stats, vocab_size=4)
        assert stats.tolist() == [0, 1, 2, 1]
        scores = torch.zeros(2, dtype=torch.float64)
        voc.curriculum_score(tokens, offsets, scores, vocab_size=4, stats=stats)
        _, want = rarity_reference(tokens.numpy(), offsets.numpy(), 4)
        assert scores.tolist() == pytest.approx(want, abs=4 * 2.0 ** -33)


def test_wrong_calls_are_refused_with_their_reason():
    with open_session('[curriculum.lin]\nplugin = "fixed_linear"\nmin_difficulty = 1\n'
                      'max_difficulty = 10\ntotal_curriculum_step = 10\n'
                      '[curriculum.voc]\nplugin = "vocabulary_rarity"\n'
                      '[curriculum.len]\nplugin = "seqlen"\n'
                      '[sampler.all]\nplugin = "curriculum_sampler"\n'
                      'clustering_type = "single_cluster"\n') as s:
        lin, voc = s.instance("curriculum", "lin"), s.instance("curriculum", "voc")
        tokens = np.array([1, 2], dtype=np.int32)
        offsets = np.array([0, 2], dtype=np.int64)
        scores = np.zeros(1)
        with pytest.raises(loom.UnimplementedError, match="has no `score`: it is a schedule"):
            lin.curriculum_score(tokens, offsets, scores, vocab_size=4)
        with pytest.raises(loom.UnimplementedError, match="has no `at`: it is a metric"):
            voc.curriculum_at(1)
        with pytest.raises(loom.UnimplementedError, match="has no `count`"):
            s.instance("curriculum", "len").curriculum_count(
                tokens, offsets, np.zeros(4, dtype=np.int64), vocab_size=4)
        with pytest.raises(loom.LoomError):
            lin.curriculum_at(0)  # steps are 1-based
        with pytest.raises(loom.InvalidArgumentError, match="not a loom.curriculum/1"):
            s.instance("sampler", "all").curriculum_at(1)
        with pytest.raises(loom.InvalidArgumentError, match="tokens: dtype float32"):
            voc.curriculum_score(tokens.astype(np.float32), offsets, scores, vocab_size=4)
        with pytest.raises(loom.InvalidArgumentError, match="one element per sample"):
            voc.curriculum_score(tokens, offsets, np.zeros(2), vocab_size=4,
                                 stats=np.ones(4, dtype=np.int64))


def test_the_data_efficiency_example_manifests_from_their_files(tmp_path):
    """The curriculum instances of examples/data_efficiency, opened from manifest files: the
    analyzer's metrics (analyze.toml as it is) count and score, and the runs' schedules
    (curriculum.toml's [curriculum.*] tables, without the comm and samplers that need a job
    and an index) give their difficulties and sequence lengths."""
    tomllib = pytest.importorskip("tomllib")
    from conftest import ROOT
    example = os.path.join(ROOT, "examples", "data_efficiency")
    tokens = np.array([3, 1, 1, 0, 2, 0, 4, 4, 4], dtype=np.uint16)
    offsets = np.array([0, 3, 4, 9], dtype=np.int64)
    with loom.Session(os.path.join(example, "analyze.toml"), log_level="error") as s:
        voc, length = s.instance("curriculum", "voc"), s.instance("curriculum", "seqlen")
        stats = np.zeros(voc.curriculum_plan(vocab_size=5)["stats_count"], dtype=np.int64)
        voc.curriculum_count(tokens, offsets, stats, vocab_size=5)
        assert stats.tolist() == [2, 2, 1, 1, 3]
        scores = np.zeros(3)
        voc.curriculum_score(tokens, offsets, scores, vocab_size=5, stats=stats)
        _, want = rarity_reference(tokens.astype(np.int64), offsets, 5)
        assert scores.tolist() == pytest.approx(want, abs=len(tokens) * 2.0 ** -33)
        length.curriculum_score(tokens, offsets, scores, vocab_size=5)
        assert scores.tolist() == [3.0, 1.0, 5.0]

    with open(os.path.join(example, "curriculum.toml"), "rb") as f:
        tables = tomllib.load(f)["curriculum"]
    lines = ["[loom]", "abi = 1"]
    for name, params in tables.items():
        lines.append(f"[curriculum.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in params.items()]
    manifest = tmp_path / "schedules.toml"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with loom.Session(str(manifest), log_level="error") as s:
        voc = s.instance("curriculum", "voc_schedule")  # fixed_root, k = 2, 1 .. 100 in 200
        slw = s.instance("curriculum", "slw")  # seqlen_warmup, truncate, 8 .. 128 in 200
        assert voc.curriculum_plan()["schedule"]
        assert slw.curriculum_plan()["seq_len_mode"] == "truncate"
        for step in (1, 2, 50, 100, 199, 200, 201, 5000):
            assert voc.curriculum_at(step) == {
                "difficulty": root_schedule(step, 1, 100, 200, 1, k=2.0), "seq_len": 0}, step
            want = root_schedule(step, 8, 128, 200, 8)
            assert slw.curriculum_at(step) == {"difficulty": want, "seq_len": int(want)}, step
