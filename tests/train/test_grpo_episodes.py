"""Multi-turn GRPO rollouts (train/grpo_episodes.py): the engine's tokens in an episode equal greedy
generate re-run over each turn's whole history (extension without re-prefill is exact), the
observations are masked out of the loss (its value and gradient equal a hand computation over the
model's tokens only), and a misbehaving environment drops its group alone, in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxgpt.decode.sampling import Sampling
from flaxgpt.envs.base import Environment, Step
from flaxgpt.models import gpt
from flaxgpt.train import grpo_task as g
from flaxgpt.train.grpo_episodes import Episodes
from flaxgpt.train.grpo_rollout import EngineRollouts, Replicas
from flaxgpt.train.policy import NONE, FullPolicy
from tests.serve.references import greedy_rows

CFG = gpt.GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=2, n_embd=32)
EOS, MAX_NEW, W = 31, 24, 64
HERE = "tests.train.test_grpo_episodes"
STOP = ["a"]  # the stop text of the environments below (set by a test before it samples)


class Letters:
    """A tokenizer of 4 letters: token t reads as 'abcd'[t % 4]; a letter encodes as its index + 4."""

    def decode(self, ids):
        return "".join("abcd"[t % 4] for t in ids)

    def encode(self, text):
        return ["abcd".index(c) + 4 if c in "abcd" else 8 for c in text]


class Talker(Environment):
    """Answers every reply with 'dcba' (reward 1 a reply) until the third."""

    max_turns = 8

    @property
    def stop(self):
        return STOP[0]

    def reset(self, prompt, **row):
        self.turn = 0

    def step(self, action):
        self.turn += 1
        return Step("dcba", 1.0, self.turn >= 3)


class Raises(Talker):
    def step(self, action):
        if self.prompt == "bad":
            raise RuntimeError("the tool crashed")
        return super().step(action)

    def reset(self, prompt, **row):
        self.prompt, self.turn = prompt, 0


class NaNReward(Raises):
    def step(self, action):
        return Step("dcba", float("nan") if self.prompt == "bad" else 1.0, True)


class Flood(Raises):
    def step(self, action):
        return Step("a" * (100 if self.prompt == "bad" else 2), 0.5, False)


class Forever(Talker):
    def step(self, action):
        return Step("b", 0.25, False)


@pytest.fixture(scope="module")
def params():
    # weights x 3: a random GPT's greedy tokens then depend on the whole history, not only the last token
    return jax.tree.map(lambda x: 3 * x, gpt.init_params(CFG, jax.random.key(5)))


def rollouts():  # greedy: one set of compiled programs for every test here
    sampling = Sampling(temperature=0.0, eos_id=EOS)
    return EngineRollouts(CFG, sampling, max_new_tokens=MAX_NEW, slots=4, max_len=W)


def data_rows(*prompts):
    return [{"prompt": p, "fields": {}, "ids": [1 + i, 9, 17 + i]} for i, p in enumerate(prompts)]


def stop_after(params, ids):
    """STOP: the letter of the 2nd token greedy decodes after ids (a reply there ends by its 2nd)."""
    STOP[0] = Letters().decode([greedy_rows(CFG, params, [ids], W, 3)[0][1]])


def segments(completion):
    """(start, end, is the model's) runs of a Completion's tokens."""
    out, s = [], 0
    for i in range(1, len(completion) + 1):
        if i == len(completion) or completion.model[i] != completion.model[s]:
            out.append((s, i, completion.model[s]))
            s = i
    return out


def test_episode_tokens_equal_generate_over_the_whole_history(params):
    """Greedy episodes, 2 prompts x G 2 on 4 slots: every reply equals what greedy generate decodes
    after the whole history before it (prompt, replies, observations) prefilled afresh; replies end at
    the stop text (tokens decoded past it dropped) and each observation 'dcba' follows as 4 tokens
    the model did not write."""
    rows = data_rows("p0", "p1")
    stop_after(params, rows[0]["ids"])
    episodes = Episodes(f"{HERE}:Talker", Letters(), EOS, MAX_NEW)
    prompts, completions, replies = episodes.sample(
        rollouts(), params, [r["ids"] for r in rows], rows, 2, seed=0
    )
    assert prompts == [r["ids"] for r in rows for _ in range(2)] and not episodes.errors
    assert completions[0] == completions[1] and completions[0].model == completions[1].model  # greedy
    turns = 0
    for prompt, c in zip(prompts, completions, strict=True):
        for start, end, mine in segments(c):
            history = prompt + list(c[:start])
            if mine:
                want = greedy_rows(CFG, params, [history], W, end - start)[0]
                assert list(c[start:end]) == want, (start, end)
                turns += 1
            else:
                assert list(c[start:end]) == Letters().encode("dcba")
        assert len(prompt) + len(c) <= len(prompt) + MAX_NEW
        observations = sum(1 for s in segments(c) if not s[2])
        assert observations <= c.reward <= observations + 1  # 1 a reply stepped
    assert len(segments(completions[0])) >= 3  # reply, observation, reply at least: extended
    # the step's episode metrics, recounted from the completions
    obs = [sum(1 for s in segments(c) if not s[2]) for c in completions]
    replies_n = [sum(1 for s in segments(c) if s[2]) for c in completions]
    env_tokens = sum(len(c) - sum(c.model) for c in completions)
    assert episodes.stats == pytest.approx(
        {
            "episodes/turns_mean": np.mean([c.reward for c in completions]),  # Talker: 1 a reply stepped
            "episodes/done_ratio": np.mean([c.reward == 3 for c in completions]),
            "episodes/observations_mean": np.mean(obs),
            "episodes/error_observations_ratio": 0.0,
            "episodes/observation_tokens_ratio": env_tokens / sum(len(c) for c in completions),
        }
    )
    assert max(replies_n) >= 2
    assert replies[0] == Letters().decode([t for t in completions[0][segments(completions[0])[-1][0] :]])
    print("replies over the 4 episodes", turns)


def test_observations_are_masked_out_of_the_loss(params):
    """A multi-turn batch's GRPO loss and gradient equal the hand computation over the model's tokens
    alone (dapo: -sum A log p over them / their count, at ratio 1); changing the targets at the
    observations' positions changes neither, and without the mask (the same tokens as one-shot
    completions) the gradient differs."""
    prompts = [[1, 2], [3]]
    completions = [
        g.Completion([5, 6, 7, 8, 9, EOS], [1, 1, 0, 0, 1, 1]),
        g.Completion([10, 11, 12, 13], [1, 0, 0, 1]),
    ]
    adv = np.array([1.5, -0.5], np.float32)
    batch = g.rollout_batch(prompts, completions, 8, adv)
    cfg = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=32)
    small = gpt.init_params(cfg, jax.random.key(2))
    objective, policy = g.GRPOObjective(g.GRPOOptions(loss_type="dapo"), 8), FullPolicy(cfg)

    def loss(p, b):
        s, (w, _) = objective.loss(policy, p, NONE, b, None, False)
        return s / w

    # by hand: model tokens' targets sit at positions len(prompt) - 1 + i for model[i] == 1
    mine = np.zeros((2, 8), np.float32)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        for i, m in enumerate(c.model):
            mine[r, len(p) - 1 + i] = m

    def by_hand(p):
        logp = jax.nn.log_softmax(policy.apply(p, NONE, jnp.asarray(batch["inputs"])), axis=-1)
        logp_BT = jnp.take_along_axis(logp, jnp.asarray(batch["targets"])[..., None], axis=-1)[..., 0]
        ratio = jnp.exp(logp_BT - jax.lax.stop_gradient(logp_BT))  # 1, with logp's gradient
        return -(adv[:, None] * ratio * mine).sum() / mine.sum()

    np.testing.assert_array_equal(batch["loss_mask"], mine)
    both = jax.jit(jax.value_and_grad(loss))  # one compile for the three batches below
    value, grad = both(small, batch)
    want_value, want = jax.jit(jax.value_and_grad(by_hand))(small)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grad, want)
    moved = dict(
        batch, targets=np.where(mine == 0, 0, batch["targets"]).astype(np.int32)
    )  # observation targets changed
    jax.tree.map(np.testing.assert_array_equal, both(small, moved)[1], grad)
    plain = g.rollout_batch(prompts, [list(c) for c in completions], 8, adv)
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), both(small, plain)[1], grad)
    assert max(jax.tree.leaves(diff)) > 1e-4


@pytest.mark.parametrize(
    "env, said",
    [
        ("Raises", "step 1 raised RuntimeError: the tool crashed"),
        ("NaNReward", "step 1 returned the reward nan, not a finite number"),
        (
            "Flood",
            "step 1's observation is 100 tokens, over grpo.max_completion_length 24; "
            "cut it in the environment",
        ),
    ],
)
def test_a_misbehaving_environment_drops_its_group_alone(params, env, said, capsys):
    """Episodes of 'good' and 'bad' prompts (G 2): the bad prompt's group is dropped (reward NaN,
    no token trained, in one line naming the environment and the prompt), the good one's trains."""
    rows = data_rows("good", "bad")
    stop_after(params, rows[1]["ids"])
    episodes = Episodes(f"{HERE}:{env}", Letters(), EOS, MAX_NEW)
    prompts, completions, _ = episodes.sample(rollouts(), params, [r["ids"] for r in rows], rows, 2, seed=3)
    assert episodes.errors == [f"environment {env} on prompt 'bad': {said}"]
    assert f"environment {env} on prompt 'bad'" in capsys.readouterr().err
    batch = g.rollout_batch(prompts, completions, W, np.zeros(4))
    assert batch["loss_mask"][2:].sum() == 0 and np.isnan([c.reward for c in completions[2:]]).all()
    assert batch["loss_mask"][:2].sum() > 0 and np.isfinite([c.reward for c in completions[:2]]).all()


@pytest.mark.devices(2)
def test_replicas_play_one_engines_episodes(params, capsys):
    """grpo.engine_replicas: episodes played by 2 replicas (each its share of the prompts and slots,
    a thread each), on one device or over 2, are one engine's, sampled at temperature 1 (the same
    keys, every turn's): the same completions, masks, rewards and replies; a misbehaving prompt's
    group dropped by whichever replica played it, its line once; the step's metrics over all."""
    rows = data_rows("good", "bad", "p2")
    ids = [r["ids"] for r in rows]
    stop_after(params, rows[0]["ids"])
    sampled = Sampling(temperature=1.0, eos_id=EOS)
    one = EngineRollouts(CFG, sampled, max_new_tokens=MAX_NEW, slots=4, max_len=W)
    episodes = Episodes(f"{HERE}:Raises", Letters(), EOS, MAX_NEW)
    want = episodes.sample(one, params, ids, rows, 2, seed=11)
    want_stats, said = dict(episodes.stats), "environment Raises on prompt 'bad'"
    assert episodes.errors == [f"{said}: step 1 raised RuntimeError: the tool crashed"]
    assert len({tuple(c) for c in want[1]}) > 2  # sampled: the episodes differ
    d = jax.devices()
    for devices in (d[:1], d[:2]):
        capsys.readouterr()
        fresh = EngineRollouts(CFG, sampled, max_new_tokens=MAX_NEW, slots=4, max_len=W)
        replicas = Replicas(fresh, devices, 2)
        got = episodes.sample(replicas, params, ids, rows, 2, seed=11)
        assert got[0] == want[0] and got[2] == want[2]
        for a, b in zip(got[1], want[1], strict=True):
            assert list(a) == list(b) and a.model == b.model
            assert a.reward == b.reward or np.isnan(a.reward) and np.isnan(b.reward)
        assert [p.slots for p in replicas.parts] == [2, 2]  # a prompt a replica at a time
        assert episodes.errors == [f"{said}: step 1 raised RuntimeError: the tool crashed"]
        assert capsys.readouterr().err.count(said) == 1 and episodes.stats == want_stats


def test_an_environment_that_never_finishes_stops_at_max_turns(params):
    """Never done: each episode ends truncated at grpo.max_turns replies (or its token budget),
    scored as it stands (0.25 a reply), nothing dropped."""
    rows = data_rows("p0", "p1")
    stop_after(params, rows[0]["ids"])
    episodes = Episodes(f"{HERE}:Forever", Letters(), EOS, MAX_NEW, max_turns=2)
    prompts, completions, _ = episodes.sample(rollouts(), params, [r["ids"] for r in rows], rows, 2, seed=4)
    assert not episodes.errors
    for c in completions:
        replies = sum(1 for s in segments(c) if s[2])
        assert replies <= 2 and len(c) <= MAX_NEW and c.reward in (0.0, 0.25, 0.5)
    assert any(sum(1 for s in segments(c) if s[2]) == 2 for c in completions)
    assert g.truncated(completions, [EOS]).all()  # mask_truncated_completions masks them all


def test_an_episode_the_environment_did_not_end_is_truncated_even_after_eos():
    """The last reply ended with EOS but the environment did not end the episode (max_turns, the
    budget): truncated (it was judged by its last token alone: trained under mask_truncated_completions)."""
    from flaxgpt.train.grpo_episodes import _Play

    episodes = Episodes(f"{HERE}:Forever", Letters(), EOS, MAX_NEW, max_turns=1)
    plays = [_Play(None, "p", MAX_NEW, [5, EOS], [1, 1], done=done) for done in (False, True)]
    plays += [_Play(None, "p", MAX_NEW, [5, 6], [1, 1], done=False)]
    completions, _ = episodes._results(plays, set(), 1)
    assert list(g.truncated(completions, [EOS])) == [True, False, True]


def test_episode_metrics_count_turns_endings_and_tool_errors():
    """stats_of over finished plays: replies, the environment's endings, observations, the share of them
    that are a tool's error answers, and the observations' share of the tokens."""
    from flaxgpt.train.grpo_episodes import _Play, stats_of

    a = _Play(None, "p", 10, tokens=[1, 2, 3, 4, 5, 6], model=[1, 1, 0, 0, 1, 1], turns=2, done=True)
    a.observations = 1
    b = _Play(None, "p", 10, tokens=[1, 2, 3, 4], model=[1, 0, 1, 0], turns=2, observations=2, errors=1)
    assert stats_of([a, b]) == pytest.approx(
        {
            "episodes/turns_mean": 2.0,
            "episodes/done_ratio": 0.5,
            "episodes/observations_mean": 1.5,
            "episodes/error_observations_ratio": 1 / 3,
            "episodes/observation_tokens_ratio": 4 / 10,
        }
    )
    assert stats_of([]) == {}
