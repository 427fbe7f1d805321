"""Multi-turn GRPO rollouts (grpo.env = "module:Class"): each completion an episode against the recipe's
environment (flaxgpt.envs), decoded by the serving engine, its row kept in the engine between turns.

    episodes = Episodes("flaxgpt.envs.calculator:Calculator", tokenizer, eos_id, max_new=256)
    prompt_ids, completions, replies = episodes.sample(engine_rollouts, weights, ids, rows, G, seed=s)

A turn: the model decodes (every slot at once, continuous batching) until its end of sequence or the
environment's stop text (a tool call's closing marker, envs.base.stop_of), looked for on the host
after each generate call (tokens decoded past it are dropped); `env.step(reply)` answers on the host;
the observation's tokens go into that slot as prompt tokens by Engine.extend (the reply's last token
fed again, then the observation; the history before it stays in the slot's window, never prefilled
again) and the slot decodes on. The other slots keep decoding while the host steps environments
between generate calls. An observation is tokenized as the environment wrote it (plain text, no chat
template: a small model trained from scratch has none; an environment that wants a wrapper such as
<tool_response>...</tool_response> writes it).

Layout: a completion is one sequence after the prompt, reply 1, observation 1, reply 2, ...: a
grpo_task.Completion, its model flags 1 on the replies' tokens and 0 on the observations', so only the
model's own tokens train. Limits: grpo.max_completion_length bounds the whole sequence (replies and
observations: the row fits the window and train row a one-shot completion has), grpo.max_turns (0:
the environment's own max_turns) the replies. An episode that reaches either ends truncated
(mask_truncated_completions applies, whether or not its last reply ended with EOS) and is scored as
it stands. A first observation from
`reset` (the same for the G episodes of a prompt) follows the prompt as prompt tokens, out of the
budget. Rewards: the environment's, summed over the episode (Completion.reward); the recipe's
reward_funcs, if any, score the final reply (its text before EOS) on top.

Bad input: an environment that raises, returns a reward that is not a finite number, an observation
that is not text, over envs.base's character limit, longer in tokens than max_completion_length or not
tokenizable (or reset observations that differ within a group) is an EnvError of one line
naming it and the prompt: printed as a warning, and that prompt's group is dropped (its completions
stay in the batch with reward NaN and no token trained) while the step's other groups train. A tool
call the parser cannot read is an observation the model sees (envs.base.ToolEnvironment), never an
error. Keys: turn k of completion n draws from the stream n + k * 2**24 of the step's seed
(EngineRollouts.rows_for), turn 0 the one-shot rollout's own.

Replicas (grpo.engine_replicas = k, grpo_rollout.Replicas): each replica plays its share of the prompts
(whole groups, in order, n counted over the step) on a thread of its own, so the episodes are one
engine's; environments are then stepped from several threads (an instance an episode, as always).
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import jax

from flaxgpt.envs import base as envs
from flaxgpt.train.grpo_task import Completion


@dataclasses.dataclass
class _Play:
    """One episode in progress: its environment and its completion so far."""

    env: object
    prompt: str  # the prompt's text: errors name it
    budget: int  # tokens its completion may take (replies and observations)
    tokens: list = dataclasses.field(default_factory=list)  # the completion: replies and observations
    model: list = dataclasses.field(default_factory=list)  # 1: the model's token, 0: the environment's
    start: int = 0  # where the reply being decoded starts in tokens
    turns: int = 0  # replies the environment has stepped
    reward: float = 0.0
    pending: tuple | None = None  # a first token still on the device: (array, index in it or None)
    done: bool = False  # the environment ended it (else truncated: max_turns or the token budget)
    observations: int = 0  # observations inserted after replies
    errors: int = 0  # of which the tool's "error..." answers (envs.base.ToolEnvironment's convention)

    def add(self, tokens, model: int):
        self.tokens += tokens
        self.model += [model] * len(tokens)


class Episodes:
    """The recipe's environment played by a run's engine; see the module docstring."""

    def __init__(self, spec: str, tokenizer, eos_id: int, max_new: int, max_turns: int = 0):
        self.spec, self.tokenizer, self.eos, self.max_new = spec, tokenizer, int(eos_id), int(max_new)
        self.max_turns = int(max_turns)
        self.turns = envs.turns_of(envs.load(spec), self.max_turns)  # loaded now: a bad spec fails first
        self.errors: list[str] = []  # the last sample's EnvErrors, one line each
        self.stats: dict[str, float] = {}  # the last sample's episode metrics (stats_of)

    def _text(self, tokens) -> str:
        return self.tokenizer.decode(tokens[:-1] if tokens and tokens[-1] == self.eos else tokens)

    def _stop_at(self, env, reply) -> int | None:
        """Tokens of `reply` up to the end of the first stop text in it, None when it has none."""
        stop = envs.stop_of(env)
        if not stop or stop not in self._text(reply):
            return None
        return next(j for j in range(1, len(reply) + 1) if stop in self._text(reply[:j]))

    def _encode(self, text, play: _Play, what: str) -> list[int]:
        """An observation's tokens; text the tokenizer cannot encode (a character vocabulary's unknown
        character) is the environment's EnvError."""
        try:
            return self.tokenizer.encode(text) if text else []
        except (ValueError, KeyError) as e:
            raise envs.EnvError(
                f"{envs.where(play.env, play.prompt)}: {what} cannot be tokenized ({e})"
            ) from None

    @staticmethod
    def _drop(error: envs.EnvError, errors: list, dropped: set, p: int):
        errors.append(str(error))
        dropped.add(p)
        print(f"warning: {error}; its group is dropped from this step", file=sys.stderr, flush=True)

    def _reset(self, row, prompt_ids, G: int):
        """The group's plays and its prompt ids (a first observation appended); EnvError if reset fails."""
        prompt = row["prompt"]
        plays = [_Play(envs.load(self.spec), prompt, self.max_new) for _ in range(G)]
        firsts = {envs.checked_reset(play.env, prompt, row["fields"]) for play in plays}
        if len(firsts) > 1:
            raise envs.EnvError(
                f"{envs.where(plays[0].env, prompt)}: reset gave {len(firsts)} different observations "
                f"to the {G} episodes of one prompt; make it depend on the prompt and row only"
            )
        first = firsts.pop()
        ids = self._encode(first, plays[0], "reset's observation")
        if len(ids) >= self.max_new:
            raise envs.EnvError(
                f"{envs.where(plays[0].env, prompt)}: reset's observation is {len(ids)} tokens, over "
                f"grpo.max_completion_length {self.max_new}; cut it in the environment"
            )
        for play in plays:
            play.budget -= len(ids)
        return plays, [*prompt_ids, *ids]

    def sample(self, rollouts, weights, prompt_ids, rows, group_size: int, *, seed: int):
        """(prompt ids, Completions, final replies' texts): N = prompts x G episodes, prompt-major.
        rollouts: the run's grpo_rollout.EngineRollouts, or its Replicas (grpo.engine_replicas: each
        plays its share of the prompts on a thread of its own, so environments are stepped from
        several threads, each episode's its own instance); rows: the prompts' data rows."""
        G = int(group_size)

        def play(engine_rollouts, mine, lo, hi):
            return self._play(engine_rollouts, mine, prompt_ids[lo:hi], rows[lo:hi], G, seed, lo)

        shares = rollouts.shares(weights, len(prompt_ids), play)
        prompts, plays, dropped, self.errors = [], [], set(), []
        for share_prompts, share_plays, share_dropped, errors in shares:
            prompts += share_prompts
            plays += share_plays
            dropped |= share_dropped
            self.errors += errors
        self.stats = stats_of([play for n, play in enumerate(plays) if n // G not in dropped])
        return prompts, *self._results(plays, dropped, G)

    def _play(self, rollouts, weights, prompt_ids, rows, G: int, seed: int, first: int):
        """One engine's episodes of `prompt_ids`, the step's prompts from `first` on (their streams
        from first * G): (prompt ids, _Plays, the step's indices of prompts whose group an EnvError
        dropped, those errors' lines)."""
        N, n0, errors = len(prompt_ids) * G, first * G, []
        plays, prompts = [None] * N, [list(p) for p in prompt_ids for _ in range(G)]
        dropped: set[int] = set()  # prompts whose group an EnvError dropped (of this share)
        if not N:
            return prompts, plays, dropped, errors
        engine = rollouts.engine_for(weights)
        if engine.slots < G:
            raise ValueError(
                f"the engine's {engine.slots} slots cannot hold a group of {G} episodes; give each "
                "engine (replica) batch_size / grpo.engine_replicas >= grpo.num_generations slots"
            )
        waiting = collections.deque(range(len(prompt_ids)))
        free, owner = list(range(engine.slots))[::-1], {}  # owner: slot -> the episode decoding there
        while waiting or owner:
            while waiting and len(free) >= G:  # a whole group: one prefill, one insert
                p = waiting.popleft()
                try:
                    group, ids = self._reset(rows[p], prompt_ids[p], G)
                except envs.EnvError as e:
                    self._drop(e, errors, dropped, p)
                    plays[p * G : p * G + G] = [_Play(None, rows[p]["prompt"], 0) for _ in range(G)]
                    continue
                slots = [free.pop() for _ in range(G)]
                streams = range(n0 + p * G, n0 + p * G + G)
                settings = [rollouts.rows_for(n, seed, 0, group[0].budget) for n in streams]
                prefix = engine.prefill(ids, settings[0], hold=G > 1)
                if G == 1:
                    engine.insert(prefix, slots[0])
                    pending = [(prefix.first, None)]
                else:
                    first_G, _ = engine.insert_group(prefix, settings, slots)
                    pending = [(first_G, g) for g in range(G)]
                for g, slot in enumerate(slots):
                    n = p * G + g
                    plays[n], prompts[n], owner[slot] = group[g], ids, n
                    group[g].pending = pending[g]
            if not owner:
                continue
            tokens_BC, new_B, done_B = engine.generate()
            self._arrive([plays[n] for n in owner.values()])
            for slot, n in list(owner.items()):
                play = plays[n]
                play.add(tokens_BC[slot, : new_B[slot]].tolist(), 1)
                try:
                    over = n // G in dropped or self._turn(
                        engine, rollouts, play, n0 + n, slot, bool(done_B[slot]), len(prompts[n]), seed
                    )
                except envs.EnvError as e:
                    self._drop(e, errors, dropped, n // G)
                    over = True
                if over:
                    if not done_B[slot]:  # its episode ended while the slot decodes on: stop it
                        engine.release(slot)
                    free.append(slot)
                    del owner[slot]
        return prompts, plays, {first + p for p in dropped}, errors

    @staticmethod
    def _arrive(plays):
        """First tokens drawn by prefills and extensions, into their episodes (one wait: they are done
        once the generate call after them is)."""
        waiting = [play for play in plays if play.pending is not None]
        host = jax.device_get([play.pending[0] for play in waiting])
        for play, h in zip(waiting, host, strict=True):
            g = play.pending[1]
            play.add([int(h if g is None else h[g])], 1)
            play.pending = None

    def _turn(self, engine, rollouts, play: _Play, n: int, slot: int, done: bool, P: int, seed: int) -> bool:
        """After a generate call: if play's reply has ended, step its environment and extend its slot
        with the observation. -> whether its episode is over."""
        reply = play.tokens[play.start :]
        cut = self._stop_at(play.env, reply)
        if cut is None and not done:
            return False  # still decoding its reply
        if cut is not None:  # tokens decoded past the stop text are dropped
            del play.tokens[play.start + cut :], play.model[play.start + cut :]
            reply = reply[:cut]
        elif reply[-1] != self.eos:
            return True  # its budget ran out inside a reply: truncated
        play.turns += 1
        step = envs.checked_step(play.env, play.prompt, self._text(reply), play.turns)
        play.reward += step.reward
        play.done = bool(step.done)
        if step.done or play.turns >= envs.turns_of(play.env, self.max_turns):
            return True
        obs = self._encode(step.observation, play, f"step {play.turns}'s observation")
        if len(obs) >= self.max_new:
            raise envs.EnvError(
                f"{envs.where(play.env, play.prompt)}: step {play.turns}'s observation is {len(obs)} "
                f"tokens, over grpo.max_completion_length {self.max_new}; cut it in the environment"
            )
        left = play.budget - len(play.tokens) - len(obs)
        if left < 1:
            return True  # no room for another reply: truncated
        start = P + len(play.tokens) - 1  # the reply's last token again (EOS, or the stop text's last)
        settings = rollouts.rows_for(n, seed, play.turns, left)
        first = engine.extend(slot, [play.tokens[-1], *obs], start, settings)
        play.add(obs, 0)
        play.start, play.pending = len(play.tokens), (first, None)
        play.observations += 1
        play.errors += (step.observation or "").lstrip().lower().startswith("error")
        return False

    def _results(self, plays, dropped: set, G: int):
        """(Completions, final replies' texts) of the episodes; a dropped group's train nothing."""
        completions, replies = [], []
        for n, play in enumerate(plays):
            if n // G in dropped:
                completions.append(Completion(play.tokens, [0] * len(play.tokens)))
                replies.append("")
            else:
                # cut short unless the environment ended it: a last reply's EOS does not say
                completions.append(Completion(play.tokens, play.model, play.reward, truncated=not play.done))
                replies.append(self._text(play.tokens[play.start :]))
        return completions, replies


def stats_of(plays) -> dict[str, float]:
    """The episodes' metrics a step logs (dropped groups left out): replies an episode, the share the
    environment ended (the rest truncated by max_turns or the token budget), observations an episode,
    the share of observations that are a tool's error answers ("error..."), and the observations'
    share of the completions' tokens (context, not trained)."""
    if not plays:
        return {}
    tokens = sum(len(p.tokens) for p in plays)
    observations = sum(p.observations for p in plays)
    return {
        "episodes/turns_mean": sum(p.turns for p in plays) / len(plays),
        "episodes/done_ratio": sum(p.done for p in plays) / len(plays),
        "episodes/observations_mean": observations / len(plays),
        "episodes/error_observations_ratio": sum(p.errors for p in plays) / max(observations, 1),
        "episodes/observation_tokens_ratio": sum(len(p.model) - sum(p.model) for p in plays) / max(tokens, 1),
    }
