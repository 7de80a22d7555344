import copy
import itertools
import math

import pytest
import torch

from macformer_lit.attention import BACKENDS
from macformer_lit.models import seq2seq
from macformer_lit.models.seq2seq import Seq2SeqTransformer, reorder_state

PAD, BOS, EOS = 0, 1, 2


def make(vocab_size=17, **kw):
    torch.manual_seed(0)
    args = dict(
        vocab_size=vocab_size,
        max_len=24,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        ffn_dim=48,
        dropout=0.0,
    )
    return Seq2SeqTransformer(**{**args, **kw}).eval()


def batch(B=3, S=7, T=6, vocab_size=17, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, vocab_size, (B, S), generator=g)
    src_mask = torch.ones(B, S, dtype=torch.bool)
    src_mask[1, S - 3 :] = False
    src[1, S - 3 :] = PAD
    tgt = torch.randint(3, vocab_size, (B, T), generator=g)
    tgt[:, 0] = BOS
    return src, src_mask, tgt


def test_shapes_and_tied_embeddings():
    model = make(share_embeddings=True)
    src, src_mask, tgt = batch()
    assert model(src, src_mask, tgt).shape == (3, 6, 17)
    assert model.lm_head.weight is model.token_emb.weight
    assert model.token_emb is model.encoder.token_emb
    untied = make(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.token_emb.weight
    assert untied.token_emb is not untied.encoder.token_emb


# The invariance tests below run in float64 and allow rounding only: 1e-12 on logits of size
# ≤ 6 (measured differences ≤ 1.8e-15; a leak or an unmasked pad moves logits by O(0.1-1)).
EXACT = dict(atol=1e-12, rtol=0)


def test_no_future_leakage_in_the_decoder():
    model = make().double()
    src, src_mask, tgt = batch()
    base = model(src, src_mask, tgt)
    for t in range(1, tgt.shape[1]):
        changed = tgt.clone()
        changed[:, t:] = (changed[:, t:] + 5) % 14 + 3
        out = model(src, src_mask, changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], **EXACT)
        assert (out[:, t] - base[:, t]).abs().max() > 1e-3


def test_source_padding_is_ignored():
    model = make().double()
    src, src_mask, tgt = batch()
    base = model(src, src_mask, tgt)
    # More padding, with arbitrary ids under it, changes nothing.
    padded = torch.cat([src, torch.randint(3, 17, (3, 4))], dim=1)
    mask = torch.cat([src_mask, torch.zeros(3, 4, dtype=torch.bool)], dim=1)
    padded[1, 4:] = torch.randint(3, 17, (padded.shape[1] - 4,))
    torch.testing.assert_close(model(padded, mask, tgt), base, **EXACT)
    # The same sentence alone (no padding at all) gives the same translation logits.
    alone = model(src[1:2, :4], None, tgt[1:2])
    torch.testing.assert_close(alone, base[1:2], **EXACT)


# Every registered backend with its default options, bare and in ppSBN. All of them build
# with their defaults (the default kernel, exp, needs no pre-SBN): one that raises fails its
# tests instead of leaving the parametrisation.
SPECS = [
    {"name": name, **extra}
    for name in sorted(BACKENDS)
    for extra in ({}, {"pre_sbn": True, "post_sbn": True})
]


def spec_id(spec):
    return spec["name"] + ("+ppsbn" if spec.get("pre_sbn") else "")


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_step_by_step_decoding_equals_the_full_pass(spec):
    """The same maths in another order: in float64 they differ by rounding only (measured at
    most 4.5e-15 on logits of size 5; float32 gives up to 2.8e-6)."""
    model = make(attention=spec).double()
    src, src_mask, tgt = batch()
    full = model(src, src_mask, tgt)
    state = model.start(model.encode(src, src_mask), src_mask)
    steps = []
    for t in range(tgt.shape[1]):
        logits, state = model.step(tgt[:, t], state)
        steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-12, rtol=0)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.get("pre_sbn")], ids=spec_id)
def test_no_future_leakage_in_training_with_ppsbn(spec):
    # Training mode: pre-SBN statistics must not carry later target positions backwards,
    # neither in decoder self-attention nor through the cross-attention queries.
    model = make(attention=spec).double().train()
    src, src_mask, tgt = batch()
    changed = tgt.clone()
    changed[:, 3:] = (changed[:, 3:] + 5) % 14 + 3
    torch.manual_seed(0)
    base = copy.deepcopy(model)(src, src_mask, tgt)
    torch.manual_seed(0)
    out = copy.deepcopy(model)(src, src_mask, changed)
    torch.testing.assert_close(out[:, :3], base[:, :3], **EXACT)
    assert (out[:, 3:] - base[:, 3:]).abs().max() > 1e-3  # the change itself does show


def test_roles_get_their_own_backend_options():
    model = make(
        attention={"name": "softmax"}, cross_attention={"name": "softmax", "dropout": 0.25}
    )
    assert model.encoder.blocks[0].attn.backend.dropout == 0.0
    assert model.blocks[0].self_attn.backend.dropout == 0.0
    assert model.blocks[1].cross_attn.backend.dropout == 0.25
    with pytest.raises(ValueError, match="unknown attention backend"):
        make(decoder_attention={"name": "nope"})


def test_greedy_is_beam_search_of_width_one():
    model = make()
    src, src_mask, _ = batch(B=4)
    greedy = model.greedy(src, src_mask, max_new_tokens=9)
    assert greedy == model.beam_search(src, src_mask, beam_size=1, max_new_tokens=9)
    assert greedy == model.generate(src, src_mask, max_new_tokens=9)
    assert all(len(h) <= 9 and EOS not in h and PAD not in h and BOS not in h for h in greedy)


class MarkovScorer:
    """Stands in for the decoder: next-token logits from a random table indexed by the
    position and by a history kept in the decoding state, so that a beam search that
    reorders the state wrongly scores hypotheses wrongly."""

    def __init__(self, vocab_size, max_len, seed):
        g = torch.Generator().manual_seed(seed)
        self.table = 2.5 * torch.randn(max_len, vocab_size, vocab_size, generator=g)
        self.V = vocab_size

    def start(self, memory, mask):
        return {"pos": 0, "self": [torch.zeros(memory.shape[0], dtype=torch.long)]}

    def step(self, tokens, state):
        history = state["self"][0] * 7 + tokens  # depends on the whole prefix
        logits = self.table[state["pos"], history % self.V]
        return logits, {"pos": state["pos"] + 1, "self": [history]}

    def logprob(self, seq):
        state = self.start(torch.zeros(1, 1), None)
        total, prev = 0.0, BOS
        for tok in seq:
            logits, state = self.step(torch.tensor([prev]), state)
            logits[:, [PAD, BOS]] = float("-inf")
            total += float(logits.log_softmax(-1)[0, tok])
            prev = tok
        return total


@pytest.mark.parametrize("seed", range(4))
def test_beam_search_finds_the_exhaustive_best(seed, monkeypatch):
    # 3 real tokens, at most 4 new ones: a beam wider than all 121 hypotheses must return
    # the exact optimum of score / length ** penalty; greedy is often worse.
    model = make(vocab_size=6)
    scorer = MarkovScorer(6, 24, seed)
    monkeypatch.setattr(model, "start", scorer.start)
    monkeypatch.setattr(model, "step", scorer.step)
    src, src_mask, _ = batch(B=2, vocab_size=6)
    src, src_mask = src[:1], src_mask[:1]
    hypotheses = []
    for n in range(4):
        hypotheses += [(list(b), list(b) + [EOS]) for b in itertools.product((3, 4, 5), repeat=n)]
    hypotheses += [(list(b), list(b)) for b in itertools.product((3, 4, 5), repeat=4)]
    for penalty in (0.0, 1.0):
        scored = [(scorer.logprob(seq) / len(seq) ** penalty, body) for body, seq in hypotheses]
        best = max(scored)[1]
        found = model.beam_search(
            src, src_mask, beam_size=81, max_new_tokens=4, length_penalty=penalty
        )
        assert found == [best]


def test_beam_search_beats_greedy_on_a_garden_path(monkeypatch):
    # First token: 3 (p = 0.6) leads to a flat distribution, 4 (p = 0.4) to a sure </s>.
    model = make(vocab_size=6)

    def step(tokens, state):
        logits = torch.full((tokens.shape[0], 6), -30.0)
        for i, tok in enumerate(tokens.tolist()):
            if tok == BOS:
                logits[i, 3], logits[i, 4] = math.log(0.6), math.log(0.4)
            elif tok == 4:
                logits[i, EOS] = 0.0
            else:
                logits[i, 2:] = 0.0
        return logits, {**state, "pos": state["pos"] + 1}

    monkeypatch.setattr(model, "start", lambda memory, mask: {"pos": 0, "self": []})
    monkeypatch.setattr(model, "step", step)
    src, src_mask, _ = batch(B=2, vocab_size=6)
    assert model.greedy(src, src_mask, max_new_tokens=5)[0][0] == 3
    assert model.beam_search(src, src_mask, beam_size=2, max_new_tokens=5, length_penalty=0.0) == [
        [4],
        [4],
    ]


def test_reorder_state_selects_batch_rows():
    state = {"a": torch.arange(6).view(3, 2), "n": 4, "l": [torch.arange(3), None]}
    out = reorder_state(state, torch.tensor([2, 2, 0]))
    assert out["a"].tolist() == [[4, 5], [4, 5], [0, 1]]
    assert out["n"] == 4 and out["l"][0].tolist() == [2, 2, 0] and out["l"][1] is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="must differ"):
        make(eos_id=PAD)
    with pytest.raises(ValueError, match="num_decoder_layers"):
        make(num_decoder_layers=0)
    with pytest.raises(ValueError, match="d_model"):
        make(d_model=0)
    model = make()
    src, src_mask, _ = batch()
    with pytest.raises(ValueError, match="beam_size"):
        model.beam_search(src, src_mask, beam_size=0)
    with pytest.raises(ValueError, match="longer than max_len"):
        model(src, src_mask, torch.ones(3, 25, dtype=torch.long))
    assert torch.isfinite(model(src, src_mask, torch.ones(3, 24, dtype=torch.long))).all()


def exhaustive_scores(model, src, src_mask, hypotheses):
    """log P(seq | src) of every hypothesis by the teacher-forced full pass in float64 (no
    decoding state at all), with the decoder's rules: <pad> and <s> are never generated.
    Hypotheses of one length go through one forward."""
    memory = model.encode(src, src_mask)
    scores = {}
    for length in sorted({len(seq) for seq in hypotheses}):
        group = [seq for seq in hypotheses if len(seq) == length]
        tgt = torch.tensor([[BOS, *seq[:-1]] for seq in group])
        n = len(group)
        mask = None if src_mask is None else src_mask.expand(n, -1)
        logits = model.decode(tgt, memory.expand(n, -1, -1), src_padding_mask=mask).double()
        logits[..., [PAD, BOS]] = float("-inf")
        logp = logits.log_softmax(-1).gather(-1, torch.tensor(group)[..., None])[..., 0]
        for seq, total in zip(group, logp.sum(-1).tolist()):
            scores[tuple(seq)] = total
    return scores


# Backends whose decoder self-attention carries a recurrent state (kv, totals and, for rmfa,
# the range reference) instead of a key/value cache; bare and in ppSBN, where pre-SBN
# normalises the decoder's queries and keys with running statistics. 32 random features keep
# it fast; the state and its reordering do not depend on their number.
RECURRENT_SPECS = [
    {**s, **({} if s["name"] == "linear" else {"num_features": 32})}
    for s in SPECS
    if s["name"] in ("rmfa", "favor", "linear")
]


@pytest.mark.parametrize("spec", RECURRENT_SPECS, ids=spec_id)
def test_beam_search_with_a_recurrent_state_finds_the_exhaustive_best(spec, monkeypatch):
    """Beam search reorders the decoding state across beams at every step. With the real
    model (eval mode, features drawn once from a fixed seed, so every pass scores with the
    same model) it must return the exact optimum of score / length ** penalty over all 121
    hypotheses of at most 4 new tokens from 3 real ones, scored without any state; and the
    logits of every beam at every step must be those of the state-free full pass on that
    beam's prefix (a state reordered wrongly moves them long before it flips an optimum:
    this model's choices depend little on the history)."""
    model = make(vocab_size=6, attention=spec).double()
    assert not model.training
    src, src_mask, _ = batch(B=2, vocab_size=6)
    bodies = [list(b) for n in range(5) for b in itertools.product((3, 4, 5), repeat=n)]
    hypotheses = [(b, b + [EOS]) for b in bodies if len(b) < 4] + [
        (b, b) for b in bodies if len(b) == 4
    ]
    assert len(hypotheses) == 1 + 3 + 9 + 27 + 81
    # Record what beam_search feeds and gets at each step, and how it reorders the beams.
    steps, reorders = [], []
    real_step = model.step

    def step(tokens, state):
        logits, state = real_step(tokens, state)
        steps.append((tokens, logits))
        return logits, state

    def reorder(state, index, depth=[0]):  # noqa: B006  (reorder_state recurses through it)
        if depth[0] == 0:
            reorders.append(index)
        depth[0] += 1
        try:
            return reorder_state(state, index)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(model, "step", step)
    monkeypatch.setattr(seq2seq, "reorder_state", reorder)
    u32 = torch.finfo(torch.float32).eps / 2
    logps = [
        exhaustive_scores(model, src[b : b + 1], src_mask[b : b + 1], [s for _, s in hypotheses])
        for b in range(2)
    ]
    for penalty in (0.0, 1.0):
        steps.clear()
        reorders.clear()
        found = model.beam_search(
            src, src_mask, beam_size=81, max_new_tokens=4, length_penalty=penalty
        )
        for b, logp in enumerate(logps):
            scored = sorted(
                ((logp[tuple(seq)] / len(seq) ** penalty, body) for body, seq in hypotheses),
                reverse=True,
            )
            # beam_search scores in float32: each of the ≤ 5 summed terms is a float32
            # log-softmax of float32-rounded logits, off by a few (≤ 8) units of roundoff
            # u = 2^-24 times the largest magnitude involved (theory; step and full pass
            # agree to 1e-12 in float64, test_step_by_step_decoding_equals_the_full_pass).
            # The optimum must beat the runner-up by more than twice that, else the
            # comparison would be decided by rounding.
            tol = 5 * 8 * u32 * max(abs(s) for s in logp.values())
            assert scored[0][0] - scored[1][0] > 2 * tol, (scored[:2], tol)
            assert found[b] == scored[0][1], (penalty, b, found[b], scored[:3])
    # Every step of the last search (the state is handled alike whatever the penalty), every
    # beam (B·K rows), against the full pass on the prefix beam_search holds for it, rebuilt
    # with its own reorder indices.
    assert len(steps) == len(reorders) == 4  # the last reorder feeds no step
    memory = model.encode(src, src_mask).repeat_interleave(81, 0)
    mask = src_mask.repeat_interleave(81, 0)
    prefix = None
    for t, (tokens, logits) in enumerate(steps):
        fed = tokens[:, None]
        prefix = fed if t == 0 else torch.cat([prefix[reorders[t - 1]], fed], 1)
        full = model.decode(prefix, memory, src_padding_mask=mask)[:, -1]
        # float64: rounding only, 1e-12 as in test_step_by_step_decoding_equals_the_full_pass
        torch.testing.assert_close(logits, full, atol=1e-12, rtol=0, msg=f"step {t}")
