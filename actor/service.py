"""The actor process: sample groups with the newest adapter weights, stream them out.

It connects a DEALER socket to the learner, says hello, and samples nothing until it
holds the learner's current weights: a restarted actor never samples with stale initial
LoRA weights. It decodes with its engine (policy/engine.py), one step at a time, and each
group goes out the moment its last row ends, whatever the order of its prompt in the data
(it names the span of the data it covers, `start_cursor` to `cursor`, so a restarted
actor neither skips nor repeats). Continuous (`actor.engine`), rows refill the batch as
others end, and with `max_staleness >= 1` the newest weights land between two decode
steps (each token records its version). Static (`actor.engine = "static"`, or a model
whose caches are not plain KVCache), a share of a batch decodes at a time; then, and
with `max_staleness = 0`, weights land only when nothing decodes.
Episodes take their turns in the same engine (actor/episodes.py); their groups go out a
batch at a time.

Flow control is by credit: the learner reports how many of this actor's groups it has
consumed (trained or dropped), and the actor's window. With `max_staleness = k`, batch
size B and N live actors, each keeps at most ceil((k + 1) * B / N) groups in flight (the
window; an actor that dies gives its share to the others), and samples every
`actor.count`-th prompt of the run's data stream (its `--slot`). The actor beats from a
thread of its own, so the learner hears it through long batches. With k = 0 it samples
only for the batch being filled: when the learner trains, it sends the new weights before
the credit, so every batch is sampled by the weights the previous batch produced; when
the learner drops groups (DAPO's filter, a reward error), the actor replaces exactly
those, with unchanged weights.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, cast

import mlx.nn as nn

import protocol
import transport
from actor.agents import AgentError, AgentRunner
from actor.completions import Policy
from actor.episodes import EpisodeRunner
from actor.gateway import Gateway
from actor.rollout import PlacedPrompt, completion_fields, rollout_frames, rollout_message
from policy.data import DataError, Prompt, PromptStream, check_context, load_prompts
from policy.engine import Engine
from policy.logprobs import plain_caches
from policy.memory import apply_memory_share
from policy.model import (
    dequantizes,
    load_policy,
    set_adapter_weights,
    tokenizer_fingerprint,
    weights_frame_bytes,
)
from policy.sampler import Completion
from protocol import sockets
from protocol.connection import ENDED, HEARTBEAT_S, Link, State, heartbeat
from protocol.messages import Partial
from protocol.worker_socket import WorkerPool
from runtime import lifecycle, spans
from runtime.config import Config, as_dict, ceil_div, credit_window, read_run_config
from runtime.heartbeat import actor_name, start_heartbeat
from transport import SEND_TIMEOUT_MS, Again, Socket, Transport, TransportError
from transport.keys import key_dir_for, run_key_dir

log = logging.getLogger("actor")


class Actor:
    def __init__(
        self,
        cfg: Config,
        slot: int,
        model: nn.Module,
        tokenizer: Any,
        stream: PromptStream,
        engine: Engine,
        link: Link,
        sock: Socket,
        net: Transport,
        signals: lifecycle.StopSignals,
        agents: tuple[AgentRunner, Gateway] | None = None,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        """An actor of its parts (`from_run_dir` builds them): `slot`, which of the run's
        `actor.count` actors it is (its share of the data, `stream`); `link`, its connection
        to the learner over `sock`; `agents`, the agent's sessions and the OpenAI API they
        call; `episodes`, the environment's."""
        self.cfg, self.slot, self.signals, self.sampling = cfg, slot, signals, cfg.sampling
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, set(tokenizer.eos_token_ids)
        self.stream, self.engine, self.episodes = stream, engine, episodes
        self.agents: AgentRunner | None = None
        if agents is not None:
            self.agents, self.gateway = agents
        self.link, self.watch, self.sock, self.net = link, link.watch, sock, net
        self.policy_version: int | None = None
        self.pending: protocol.Message | None = None  # newest weights not yet applied
        self.groups_sent = 0
        self.groups_consumed = 0
        self.timings: dict[str, float] = {}  # newest weight-sync times, sent with rollouts
        train = cfg.train
        # Until the learner says otherwise (its hello, its credit): the config's k, and this
        # slot's share of the window as if every actor were live.
        self.max_staleness = train.max_staleness
        self.window = credit_window(train.max_staleness, train.batch_size, cfg.actor.count)
        # The heartbeat thread shares the socket: every use of it holds this lock, briefly
        # (reentrant: a receive beats through `send` while it holds it).
        self.lock = threading.RLock()
        self.beating = threading.Event()
        self.last_beat = float("inf")  # the last heartbeat (monotonic); none before the first hello
        # Groups in the engine, by key, and when each went in (perf_counter).
        self.decoding: dict[int, tuple[PlacedPrompt, float]] = {}
        self.groups_added = 0
        self.decode_s = 0.0  # decoding time since groups last went out
        self.partial_every = 0  # the learner's hello says (PROTOCOL.md, `partial`); 0: none
        self.steps = 0  # decode steps so far

    @classmethod
    def from_run_dir(
        cls,
        run_dir: Path,
        signals: lifecycle.StopSignals | None = None,
        key_dir: Path | None = None,
        slot: int = 0,
        connect: str | None = None,
        net: Transport | None = None,
    ) -> Actor:
        """The run's actor in `slot`: its model and data loaded, connected to the learner.
        `key_dir`: the CURVE keys to connect with over TCP (default: the run's own).
        `slot`: which of the run's `actor.count` actors this is (its share of the data).
        `connect`: the learner's endpoint, for an actor on another machine (default:
        the run directory's endpoints.json). `net`: the transport (default: ZeroMQ)."""
        cfg = read_run_config(run_dir)
        if not 0 <= slot < cfg.actor.count:
            raise DataError(
                f"--slot {slot}: the run has actor.count = {cfg.actor.count} actors, "
                f"slots 0 to {cfg.actor.count - 1}"
            )
        model, tokenizer, prompts = load_actor_policy(cfg)
        data, s, env = cfg.data, cfg.sampling, cfg.env
        stream = PromptStream(prompts, data.shuffle, data.seed, slot=slot, slots=cfg.actor.count)
        net = net or transport.default()
        # Under an orchestrator the lifeline ends us; started by hand, we end when the
        # learner has been unreachable for good (the watch).
        if connect is not None and env.environment:
            raise DataError(
                "--connect: an actor on another machine cannot serve an environment yet "
                "(its env socket is bound on the learner's machine); run it there"
            )
        endpoints = {"learner": connect} if connect else protocol.read_endpoints(run_dir)
        insecure = cfg.run.insecure
        keys = (
            key_dir_for(endpoints["learner"], key_dir, insecure)
            if key_dir is not None
            else run_key_dir(run_dir, endpoints["learner"], insecure)
        )
        sock, watch = sockets.connect(
            net, endpoints["learner"], keys, sockets.frame_limit(weights_frame_bytes(model))
        )
        log.info("connecting to the learner at %s%s", endpoints["learner"], " (CURVE)" if keys else "")
        # Where to look whether the run is over: none with --connect, whose run directory is a
        # copy on another machine.
        link = Link(watch, "learner", log, run_dir=run_dir if connect is None else None)
        static = cfg.actor.engine == "static" or not plain_caches(model)
        eos_ids = set(tokenizer.eos_token_ids)
        engine = Engine(model, s, eos_ids, s.seed, cfg.decode_rows, static)
        agents = serve_agents(cfg, model, tokenizer, engine, prompts[0]) if cfg.agent.enabled else None
        episodes = None
        if env.environment:
            episodes = play_env(cfg, net, endpoints["env"], keys, model, tokenizer, engine, prompts[0])
        signals = signals or lifecycle.StopSignals()
        return cls(cfg, slot, model, tokenizer, stream, engine, link, sock, net, signals, agents, episodes)

    def send(self, kind: str, header: dict, arrays: dict | None = None) -> None:
        self.send_frames(protocol.encode(kind, header, arrays))

    def send_frames(self, frames: list) -> None:
        with self.lock:
            self.sock.send(frames)

    def beat(self) -> None:
        """Every HEARTBEAT_S, from a thread: the learner takes a silent actor for gone."""
        while not self.beating.wait(HEARTBEAT_S / 2):
            try:
                with self.lock:
                    self.beat_if_due()
            except TransportError:  # closing, or the connection refused for good: the loop says so
                return

    def beat_if_due(self) -> None:
        """Send a heartbeat if none went out for HEARTBEAT_S (the caller holds the lock)."""
        if time.monotonic() - self.last_beat >= HEARTBEAT_S:
            self.send(protocol.HEARTBEAT, heartbeat("actor", slot=self.slot))
            self.last_beat = time.monotonic()

    def receive(self, timeout_ms: int) -> None:
        with self.lock:
            # The loop waiting here takes the lock again at once: under load the heartbeat
            # thread can wait for it for seconds, so the waiting loop beats too.
            self.beat_if_due()
            messages = list(sockets.incoming(self.sock, timeout_ms))
        for incoming in messages:
            self.take(incoming)

    def take(self, incoming: sockets.Incoming) -> None:
        """Keep the newest weights message; never raise on a bad message."""
        msg = incoming.msg
        if msg is None:
            log.error("dropped a malformed message: %s", incoming.error)
            return
        state = self.link.take(msg)  # the learner's hello and stop
        if msg.kind == protocol.WEIGHTS:
            if protocol.newer_weights(self.pending, msg) is msg:
                self.pending = msg
                sent_at = msg.header.get("sent_at")
                # Same machine, same clock: sent -> received and decoded.
                if isinstance(sent_at, float):
                    self.timings["weights_transfer_s"] = time.time() - sent_at
        elif msg.kind == protocol.CREDIT:
            self.groups_consumed = max(self.groups_consumed, msg["groups_consumed"])
            window = msg.header.get("window")
            if type(window) is int and window > 0 and window != self.window:
                log.info("window: %d groups in flight (was %d)", window, self.window)
                self.window = window
        elif msg.kind == protocol.STOP and state is not State.AWAY:  # away: it comes back
            log.info("learner says stop: %s", msg["reason"])
        elif msg.kind == protocol.HELLO and msg.header.get("attached") is not False:
            log.info("learner pid %s accepted the handshake", msg["pid"])
            self.keep_learner_staleness(msg.header.get("max_staleness"))
            every = msg.header.get("partials")
            self.partial_every = every if type(every) is int and every > 0 else 0
            # Where the slot's data continues (a restarted actor, a resumed run, a new
            # connection): after the groups the learner holds, skipping those it holds beyond.
            cursor, skip = msg.header.get("data_cursor"), msg.header.get("data_skip")
            if cursor is not None and not protocol.is_data_cursor(cursor):
                log.warning(
                    "the learner's data_cursor %r is no [epoch, position]; starting the data over", cursor
                )
            cursor = cursor if protocol.is_data_cursor(cursor) else [0, 0]  # nil: the data's start
            skip = [tuple(c) for c in skip if protocol.is_data_cursor(c)] if isinstance(skip, list) else []
            if self.agents is not None:  # sessions of the stream being replaced
                self.agents.clear()
            elif self.episodes is None:  # groups drawn from the stream being replaced
                self.engine.clear()
                self.decoding.clear()
                self.decode_s = 0.0
            s = self.stream
            self.stream = PromptStream(
                s.prompts, s.shuffle, s.seed, (cursor[0], cursor[1]), s.slot, s.slots, skip
            )
            log.info(
                "data cursor from the learner: epoch %d, position %d%s",
                *cursor,
                f"; {len(skip)} prompts beyond it are held already" if skip else "",
            )

    def wait_for_learner(self) -> None:
        """Nothing to decode: wait (up to 200 ms) for the first weights, or for credit."""
        what = "wait for weights" if self.policy_version is None else "wait for credit"
        with spans.span(what, spans.WAIT):
            self.receive(200)

    def apply_pending(self) -> None:
        if self.pending is None:
            return
        msg, self.pending = self.pending, None
        t0 = time.perf_counter()
        try:
            with spans.span("apply weights", version=msg["version"]):
                set_adapter_weights(self.model, msg.arrays)
        except ValueError as e:
            log.error("ignored weights of version %d: %s", msg["version"], e)
            return
        self.timings["weights_apply_s"] = time.perf_counter() - t0
        self.policy_version = msg["version"]

    def next_prompt(self) -> PlacedPrompt:
        """The slot's next prompt, where it is in the data, and its first noise id. Noise
        ids follow the prompt's place in the data stream, so a prompt draws the same noise
        whatever actor (or resumed run) samples it."""
        prompt = next(self.stream)
        return PlacedPrompt(
            prompt,
            list(self.stream.start),
            list(self.stream.cursor),
            self.stream.index * self.sampling.group_size,
        )

    def play_episodes(self, n: int) -> None:
        """`n` groups played as episodes together, then sent."""
        episodes = cast(EpisodeRunner, self.episodes)
        drawn = [self.next_prompt() for _ in range(n)]
        t0 = time.perf_counter()
        with spans.span("play episodes", groups=n):
            played = episodes.run([d.prompt for d in drawn], [d.first_noise for d in drawn], self.interrupted)
        if played is None:
            return  # stopping: the learner holds none of these; a restarted actor samples them
        gen_s = (time.perf_counter() - t0) / n
        for d, group in zip(drawn, played):
            fields, arrays = group.fields(self.decode)
            self.send_group(d, {**fields, "env_retries": episodes.retries}, arrays, gen_s)

    def stream_groups(self) -> None:
        """One decode step (policy/engine.py): new groups go in as the credit allows, and
        each group is sent the step its last row ends. Continuous with max_staleness >= 1,
        new weights land between two steps; otherwise only when nothing decodes, so that
        every group is sampled by one version (with 0, the weights of the step before).
        Static, groups go in only when nothing decodes, at most a share of a batch at a
        time so that newer weights land between batches."""
        engine = self.engine
        in_flight = self.max_staleness >= 1 and not engine.static
        if self.pending is not None and (in_flight or not engine.busy):
            self.apply_pending()
            self.give_up_stale()
        # Groups added and not yet sent count against the credit.
        room = self.window - (self.groups_sent - self.groups_consumed) - len(self.decoding)
        if self.policy_version is None or (room <= 0 and not engine.busy):
            self.wait_for_learner()
            return
        if engine.static:
            room = 0 if engine.busy else min(room, self.actor_share())
        if self.pending is None or in_flight:
            for _ in range(room):
                self.groups_added += 1
                drawn = self.next_prompt()
                self.decoding[self.groups_added] = drawn, time.perf_counter()
                noise = list(range(drawn.first_noise, drawn.first_noise + self.sampling.group_size))
                engine.add(self.groups_added, drawn.prompt.prompt_ids, noise)
        t0 = time.perf_counter()
        done = engine.step(self.policy_version)
        self.decode_s += time.perf_counter() - t0
        for key, completions in done:
            drawn, since = self.decoding.pop(cast(int, key))
            # Each group's share of the decoding time since the last groups went out.
            fields, arrays = self.completions(drawn.prompt, completions)
            fields["in_flight"] = self.still_decoding()
            took = time.perf_counter() - since
            self.send_group(drawn, fields, arrays, self.decode_s / len(done), str(key), took)
        if done:
            self.decode_s = 0.0
        self.steps += 1
        if self.partial_every and self.steps % self.partial_every == 0:
            self.send_partials()

    def send_partials(self) -> None:
        """Each decoding group's completions so far, for the learner to take their
        reference logprobs while it would wait (PROTOCOL.md, `partial`)."""
        for key, (prompt, rows) in self.engine.so_far().items():
            self.send_frames(Partial.of(str(key), prompt, rows).frames())

    def still_decoding(self) -> list[int]:
        """Each group still decoding, by its oldest token's version (PROTOCOL.md,
        `in_flight`): the learner keeps room in its batch for those that can join no later
        one, rather than fill it with younger groups and drop them as stale."""
        return sorted(self.engine.oldest_versions().values())

    def keep_learner_staleness(self, k: object) -> None:
        """The learner's max_staleness is the run's (its hello says it; without it, our
        config's): an actor started by hand with its own copy of the config could otherwise
        mix versions the learner refuses, or give up groups it would train. The window, until
        the learner's credit says it, is this slot's share of (k + 1) * B under that k."""
        own = self.cfg.train
        k = k if type(k) is int and k >= 0 else own.max_staleness
        if k != self.max_staleness:
            self.max_staleness = k
            self.window = credit_window(k, own.batch_size, self.cfg.actor.count)
        if k != own.max_staleness:
            log.warning(
                "the learner's max_staleness is %d, this actor's config says %d: keeping to %d "
                "(a window of %d groups until the learner's credit says it)",
                k,
                own.max_staleness,
                k,
                self.window,
            )

    def give_up_stale(self) -> None:
        """Stop decoding the groups the learner can no longer train on: their oldest token
        came from weights more than `max_staleness` versions before the ones just applied,
        and the learner's version only grows, so it would drop them as stale when they
        arrived. Each is sent at once as a group dropped as "stale" (PROTOCOL.md, `error`),
        which holds its place in the data; its credit comes back now, not when its longest
        row would have ended. Under long-tailed lengths these are the longest groups."""
        if self.policy_version is None:
            return
        for key in self.engine.started_before(self.policy_version - self.max_staleness):
            self.engine.cancel(key)
            drawn, _ = self.decoding.pop(cast(int, key))
            log.info(
                "data row %s: stopped sampling its group, stale under weights version %d (max_staleness %d)",
                drawn.prompt.index,
                self.policy_version,
                self.max_staleness,
            )
            empty = [Completion([], [], "length")] * self.sampling.group_size
            fields, arrays = self.completions(drawn.prompt, empty)
            fields |= {"error": "stale", "in_flight": self.still_decoding()}
            self.send_group(drawn, fields, arrays, 0.0, str(key))

    def run_sessions(self) -> None:
        """Agent sessions (actor/agents.py): new groups start as the credit allows, every
        session's calls decode together, and each group is sent when its sessions have all
        reported. Weights land between decode steps with max_staleness >= 1; with 0, only
        when no session runs."""
        agents = cast(AgentRunner, self.agents)
        in_flight = self.max_staleness >= 1
        if self.pending is not None and (in_flight or not agents.busy):
            self.apply_pending()
        room = self.window - (self.groups_sent - self.groups_consumed) - len(agents.groups)
        if self.policy_version is None or (room <= 0 and not agents.busy):
            self.wait_for_learner()
            return
        if self.pending is None or in_flight:
            for _ in range(room):
                agents.start_group(self.next_prompt())
        t0 = time.perf_counter()
        done = agents.pump(self.policy_version)
        self.decode_s += time.perf_counter() - t0
        if not self.engine.busy:
            self.receive(5)  # the sessions' agents are at work: wait a little, not spin
        for g in done:
            fields, arrays = agents.fields(g, self.decode)
            # Each group's share of the decoding time since groups last went out, as
            # `stream_groups` counts it (not the agents' own time).
            gen_s = self.decode_s / len(done)
            self.send_group(g.drawn, {**fields, "env_retries": agents.retries}, arrays, gen_s)
        if done:
            self.decode_s = 0.0

    def actor_share(self) -> int:
        """The groups a batch at a time takes (static, episodes): our window's share of one
        batch, so that newer weights land between batches (Config.actor_share while every
        actor is live; the learner's window says when some are not)."""
        return ceil_div(self.window, self.max_staleness + 1)

    def send_group(
        self,
        drawn: PlacedPrompt,
        fields: dict,
        arrays: dict,
        gen_s: float,
        group_id: str | None = None,
        decoding_s: float | None = None,
    ) -> None:
        """`group_id`: the engine's key (what its partials said), else the groups sent so far.
        `decoding_s`: the seconds since it went into the engine, for the timeline (under
        max_staleness k, k + 1 steps take at least the longest group's: docs/timeline.md)."""
        group_id = str(self.groups_sent) if group_id is None else group_id
        rollout = rollout_message(drawn, group_id, self.policy_version, self.timings, fields, arrays, gen_s)
        with spans.span("send", group=group_id) as span:
            if decoding_s is not None:
                span["decoding_s"] = round(decoding_s, 3)
            self.send_frames(rollout_frames(rollout))
        self.groups_sent += 1

    def completions(self, prompt: Prompt, completions: list[Completion]) -> tuple[dict, dict]:
        return completion_fields(prompt, completions, self.decode)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def interrupted(self) -> bool:
        """Between turns of an episode: the learner said stop, or a stop signal came."""
        self.receive(0)
        return self.link.ended or self.signals.requested

    def greet(self) -> None:
        """Say hello: once at the start, and again on every new connection. A TCP connection
        that dropped comes back as a stranger to the learner (a new identity; what was on
        the wire is lost), so the actor starts over as a restarted actor does: the learner
        sends weights and where the slot's data continues, and the credit counts from 0."""
        self.receive(0)  # what the old connection brought, before starting over
        self.link.saying_hello()
        # What the engine holds is the old connection's: it waits (no weights) and goes when
        # the learner's hello says where the data continues.
        self.policy_version, self.pending, self.groups_sent, self.groups_consumed = None, None, 0, 0
        if not self.can_send():
            self.link.hello_failed()  # the loop says why (refused: exit 4), or says hello again
            return
        try:
            self.send(
                protocol.HELLO,
                {
                    "role": "actor",
                    "model": self.cfg.model.path,
                    "tokenizer": tokenizer_fingerprint(self.tokenizer),
                    "lora": as_dict(self.cfg.lora),
                    "pid": os.getpid(),
                    "slot": self.slot,
                },
            )
        except Again:  # the connection went between the poll and the send (a refused key)
            self.link.hello_failed()

    def can_send(self) -> bool:
        """Whether the socket takes a message within the send timeout. A refused connection
        is gone for good and a send would wait the whole timeout, so the watch is asked
        meanwhile: refused means False at once."""
        deadline = time.monotonic() + SEND_TIMEOUT_MS / 1000
        while time.monotonic() < deadline:
            with self.lock:
                if self.sock.poll(100, writable=True):
                    return True
            self.watch.down_for()
            if self.watch.refused:
                return False
        return False

    def run(self) -> None:
        if self.agents is not None:
            self.gateway.start()
        self.greet()
        self.last_beat = time.monotonic()
        threading.Thread(target=self.beat, name="actor-heartbeat", daemon=True).start()
        while not (self.link.ended or self.signals.requested):
            if self.link.check() in ENDED:
                return  # refused for good, the run is over, or the learner is gone
            why = self.link.hello_due()
            if why:
                log.warning("the learner does not know us (%s); saying hello again", why)
                self.greet()
            self.receive(0)
            if self.agents is not None:
                self.run_sessions()
                continue
            if self.episodes is None:
                self.stream_groups()
                continue
            self.apply_pending()
            room = self.window - (self.groups_sent - self.groups_consumed)
            if self.policy_version is None or room <= 0:
                self.wait_for_learner()
                continue
            self.play_episodes(min(room, self.actor_share()))

    def close(self, final: bool = True) -> None:
        """`final`: the run is over, so env workers exit (else they wait for a new actor)."""
        if self.agents is not None:
            self.gateway.stop()
            self.agents.close()
        if self.episodes is not None:
            self.episodes.pool.close(
                "the run is over" if final else "the actor stops; a new one will come", final
            )
        self.beating.set()
        with self.lock:  # the heartbeat thread is out of the socket
            self.watch.close()
        self.sock.close()
        self.net.close()


def load_actor_policy(cfg: Config) -> tuple[nn.Module, Any, list[Prompt]]:
    """The policy the actor samples with (its base weights quantized if `actor.quantize_bits`),
    its tokenizer, and the run's prompts, checked against the model's context."""
    bits = cfg.actor.quantize_bits
    log.info("loading %s (base weights: %s)", cfg.model.path, f"{bits}-bit" if bits else "as saved")
    dequantize = dequantizes(cfg.model.dequantize_on_cpu)
    model, tokenizer, _ = load_policy(cfg.model.path, cfg.lora, quantize_bits=bits, dequantize=dequantize)
    data = cfg.data
    prompts = load_prompts(
        data.prompts, tokenizer, cfg.sampling.max_prompt_tokens, data.split, data.prompt_column
    )
    check_context(
        prompts,
        getattr(getattr(model, "args", None), "max_position_embeddings", None),
        cfg.max_completion_tokens,
    )
    return model, tokenizer, prompts


def serve_agents(
    cfg: Config, model: nn.Module, tokenizer: Any, engine: Engine, first: Prompt
) -> tuple[AgentRunner, Gateway]:
    """The agent's sessions, and the OpenAI API they call (loopback unless told)."""
    context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    eos_ids = set(tokenizer.eos_token_ids)
    try:
        runner = AgentRunner(
            cfg.agent, cfg.reward.search_path, engine, tokenizer, eos_ids, cfg.sampling, context
        )
    except AgentError as e:
        raise DataError(str(e)) from None
    if isinstance(first.prompt, list):
        runner.renderer.check(first.prompt)
    policy = Policy(model, tokenizer, Path(cfg.model.path).name, cfg.sampling, None)
    return runner, Gateway(cfg.agent.host, runner, policy)


def play_env(
    cfg: Config,
    net: Transport,
    endpoint: str,
    keys: Path | None,
    model: nn.Module,
    tokenizer: Any,
    engine: Engine,
    first: Prompt,
) -> EpisodeRunner:
    """The environment's episodes, played with the env workers at `endpoint`."""
    # max_attempts=1: the runner counts an episode's attempts itself.
    pool = WorkerPool(
        net,
        endpoint,
        "env_worker",
        protocol.OBSERVATION,
        cfg.env.timeout_s,
        max_attempts=1,
        owner_role="actor",
        keys=keys,
    )
    eos_ids = set(tokenizer.eos_token_ids)
    episodes = EpisodeRunner(pool, model, tokenizer, eos_ids, cfg.sampling, cfg.env, engine)
    episodes.renderer.check(first.prompt)
    return episodes


def main(run_dir: str, key_dir: str | None = None, slot: int = 0, connect: str | None = None) -> int:
    """Stream rollouts until the learner says stop or a stop signal arrives; returns the
    exit code (runtime.lifecycle)."""
    signals = lifecycle.StopSignals().install()
    lifecycle.watch_lifeline()
    start_heartbeat(run_dir, actor_name(slot, read_run_config(run_dir).actor.count))
    apply_memory_share()
    actor = Actor.from_run_dir(Path(run_dir), signals, Path(key_dir) if key_dir else None, slot, connect)
    spans.start(run_dir, actor_name(slot, actor.cfg.actor.count), actor.cfg.log.timeline)
    try:
        actor.run()
    finally:
        # The run is over when the learner says so, or when we are stopped for its end;
        # a crash, a restart or a lost orchestrator leave the env workers waiting.
        told = actor.link.state in (State.STOPPED, State.INCOMPATIBLE)
        actor.close(told or (signals.requested and lifecycle.stop_is_final(run_dir)))
    if actor.link.state in (State.INCOMPATIBLE, State.REFUSED):
        return lifecycle.EXIT_USER_ERROR  # another model or LoRA config, a refused key: a restart won't help
    if actor.link.state is State.LOST:
        return lifecycle.EXIT_CRASH
    return signals.exit_code()
