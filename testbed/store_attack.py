"""Attack run against a live store on loopback: what an attacker and a careless outside writer would send.

    python -m testbed.store_attack --json store_attack.json

Bounded and seeded. Sections, each against a real `graft-store serve` process (a crash is a dead process):
1. schemathesis with every check (`--checks all`) on the live /openapi.json;
2. hand-made bad inputs: paths, query parameters, headers, bodies, methods, malformed HTTP on a raw socket;
3. mutated pushes: bit-flipped, truncated and spliced Arrow bodies, schema-aware mutations of JSON bodies;
4. SIGKILLs of the server while two clients push, each followed by a restart: every acknowledged group must be
   readable, and the files `manifest.json` lists must count what the API counts;
5. lookups from 8 threads while 2 writer processes write shards into the folder and compaction runs.
Prints one JSON object: requests, answers by status, 5xx, no-answers, crashes, groups acknowledged vs readable.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from graft.schemas import PeerLookupRequest, Rollout, RolloutGroup, group_advantages, groups_to_table, prompt_id
from graft.services.store_api.http.client import StoreClient, StoreError
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local import live_files, write_groups

ARROW = "application/vnd.apache.arrow.stream"
CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
INTERESTING = [None, -1, 0, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 5e-324, float("nan"), "", "x" * 5000,
               "../x", "a/b", "\u0000", "\udcff", True, False, [], {}, [[1]], "NaN", 1.5, -0.0]


# ------------------------------------------------------------------ inputs


def attack_group(index: int, model: str, size: int = 4, tokens: int = 8, step: int = 0,
                 group_id: str | None = None) -> RolloutGroup:
    """A valid group (mixed rewards) for prompt `index`, the same bytes for the same arguments."""
    rng = random.Random(index)
    rewards = [float(i % 2) for i in range(size)]
    advantages = [float(np.float32(a)) for a in group_advantages(rewards)]
    gid = group_id or f"{model}-{index}-{step}"
    problem = f"What is {index} + {index + 1}?"
    rollouts = []
    for i, (reward, advantage) in enumerate(zip(rewards, advantages)):
        logprobs = [float(np.float32(-rng.random())) for _ in range(tokens)]
        text = f"the answer is \\boxed{{{2 * index + 1 if reward else 0}}}"
        rollouts.append(Rollout(
            rollout_id=f"{gid}-{i}", group_id=gid, prompt_id=prompt_id(problem), dataset="attack", model_id=model,
            tokenizer_id="tok", policy_step=step, created_at=CREATED, temperature=1.0, top_p=1.0, max_tokens=64,
            completion_text=text, completion_token_ids=[rng.randrange(1, 50_000) for _ in range(tokens)],
            token_logprobs=logprobs, logprob_sum=sum(logprobs[:-1]), num_tokens=tokens, num_bytes=len(text.encode()),
            finish_reason="stop", reward=reward, correct=reward > 0, advantage=advantage, group_size=size,
        ))
    return RolloutGroup(rollouts=rollouts)


def arrow_bytes(groups: list[RolloutGroup]) -> bytes:
    table = groups_to_table(groups)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def mutate_bytes(rng: random.Random, body: bytes, other: bytes) -> bytes:
    """Bit flips, a truncation, a splice with another body, a repeated range, or an overwritten 32-bit word."""
    data = bytearray(body)
    kind = rng.choice(["flip", "flip", "flip", "truncate", "splice", "repeat", "word"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            position = rng.randrange(len(data))
            data[position] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[rng.randrange(len(data)):]
    elif kind == "splice":
        data = data[:rng.randrange(len(data))] + other[rng.randrange(len(other)):]
    elif kind == "repeat":
        a = rng.randrange(len(data))
        b = min(len(data), a + rng.randint(1, 512))
        data = data[:b] + data[a:b] + data[b:]
    else:
        position = rng.randrange(0, len(data) - 8)
        value = rng.choice([0, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, rng.getrandbits(32)])
        data[position:position + 4] = value.to_bytes(4, "little")
    return bytes(data)


def _leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, i))
    yield path, node


def _at(node, path):
    for key in path:
        node = node[key]
    return node


def mutate_json(rng: random.Random, payload: dict) -> dict:
    """1-3 schema-aware changes of a valid push: a value replaced by an edge case, a key dropped or added, a list
    item repeated, or a value copied from elsewhere in the push (ids, sizes and lists that disagree)."""
    payload = copy.deepcopy(payload)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p, _ in _leaves(payload) if p]
        if not paths:  # an earlier change deleted the whole push: nothing left to change
            break
        path = rng.choice(paths)
        parent, key = _at(payload, path[:-1]), path[-1]
        kind = rng.choice(["value", "value", "value", "delete", "add", "copy"])
        if kind == "value":
            parent[key] = copy.deepcopy(rng.choice(INTERESTING))
        elif kind == "delete":
            del parent[key]
        elif kind == "add":
            if isinstance(parent, dict):
                parent[rng.choice(["bogus", "rollout_id", "group_size"])] = rng.choice(INTERESTING)
            else:
                parent.append(copy.deepcopy(rng.choice(parent) if parent else None))
        else:
            parent[key] = copy.deepcopy(_at(payload, rng.choice(paths)))
    return payload


def json_bytes(payload) -> bytes:
    return json.dumps(payload).encode("utf-8", "surrogatepass")  # lone surrogates: invalid UTF-8 on purpose


# ------------------------------------------------------------------ bookkeeping


class Tally:
    """Answers by status, requests without an answer, and the groups acknowledged by pushes."""

    def __init__(self):
        self.statuses: Counter[int] = Counter()
        self.no_answer = 0
        self.examples_5xx: list[str] = []
        self.examples_no_answer: list[str] = []
        self.acknowledged: set[str] = set()
        self.lock = threading.Lock()

    def answer(self, what: str, response: httpx.Response | None) -> None:
        with self.lock:
            if response is None:
                self.no_answer += 1
                if len(self.examples_no_answer) < 5:
                    self.examples_no_answer.append(what)
                return
            self.statuses[response.status_code] += 1
            if response.status_code >= 500 and len(self.examples_5xx) < 5:
                self.examples_5xx.append(f"{what}: {response.status_code} {response.text[:200]}")

    def summary(self) -> dict:
        return {"requests": sum(self.statuses.values()) + self.no_answer, "by_status": dict(sorted(self.statuses.items())),
                "5xx": sum(n for s, n in self.statuses.items() if s >= 500), "no_answer": self.no_answer,
                "examples_5xx": self.examples_5xx, "examples_no_answer": self.examples_no_answer}


def send(tally: Tally, client: httpx.Client, what: str, method: str, path: str, **kwargs) -> httpx.Response | None:
    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        response = None
        what = f"{what}: {exc!r}"[:300]
    tally.answer(what, response)
    return response


def crashed(server: StoreServer) -> bool:
    return server.process is not None and server.process.poll() is not None


# ------------------------------------------------------------------ 1. schemathesis


def run_schemathesis(url: str, examples: int, seed: int) -> dict:
    """schemathesis' own command line with every check; failures counted by check code."""
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json", "--checks", "all",
               "-n", str(examples), "--seed", str(seed), "--workers", "1", "--no-color"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800).stdout
    generated = re.search(r"(\d+) generated", out)
    failures = dict(re.findall(r"❌ (ST\d+ [^:\n]+): (\d+)", out))
    return {"command": " ".join(command[1:]), "test_cases": int(generated.group(1)) if generated else None,
            "failures_by_check": {k: int(v) for k, v in failures.items()},
            "server_errors": sum(int(v) for k, v in failures.items() if "Server error" in k)}


# ------------------------------------------------------------------ 2. hand-made bad inputs


def hand_made(url: str, port: int, tally: Tally) -> dict:
    lookup = "/v1/peer-groups/lookup"
    base = {"prompt_ids": ["0" * 16], "learner_model": "learner"}
    cases: list[tuple[str, str, str, dict]] = []
    for path in ["/v1/groups/..%2F..%2Fetc%2Fpasswd", "/v1/groups/%00", "/v1/groups/" + "a" * 10_000, "/v1/groups/é",
                 "/v1/groups/a%2Fb", "/v1/groups/.", "/v1/prompts/" + "f" * 16 + "/groups?limit=0",
                 "/v1/prompts/../groups", "/v1/prompts/%ff/groups", "/v1//groups", "/docs/../v1/stats", "/" + "x" * 8000]:
        cases.append(("path", "GET", path, {}))
    for params in [{"min_policy_step": 2**64}, {"max_policy_step": -1}, {"min_reward": "nan"}, {"min_reward": "inf"},
                   {"max_reward": "1e999"}, {"limit": 0}, {"limit": 1001}, {"limit": "1e3"}, {"correct": "maybe"},
                   {"cursor": "%%%"}, {"cursor": "YTpi"}, {"cursor": "LTE6MA"}, {"cursor": "MToyOjM"}, {"cursor": "x" * 65},
                   {"cursor": "OTk5OTk5OTk5OTk5OTk5OTk5OTk5OTk5Ojk5"}, {"model": "\u0000"}, {"prompt_id": "G" * 16},
                   {"dataset": "x" * 60_000}, {"min_reward": 0.9, "max_reward": 0.1}]:
        cases.append(("query", "GET", "/v1/rollouts", {"params": params}))
    for body in [b"", b"null", b"[]", b'"x"', b"1", b"{", b"[" * 100_000 + b"]" * 100_000, b'{"prompt_ids": "x"}',
                 json_bytes({**base, "prompt_ids": ["a"] * 1025}), json_bytes({**base, "learner_model": "x" * 1_000_000}),
                 json_bytes({**base, "groups_per_prompt": 2**64}), json_bytes({**base, "max_age_s": 1e308}),
                 json_bytes({**base, "max_age_s": -1}), json_bytes({**base, "peer_models": []}),
                 json_bytes({**base, "informative_only": 0.0}), json_bytes({**base, "min_policy_step": 2**70}),
                 json_bytes({**base, "prompt_ids": [None]}), b'{"prompt_ids": ["a"], "prompt_ids": ["b"], "learner_model": "x"}',
                 json_bytes({**base, "\udcff": 1}), json_bytes({**base, "learner_model": "\udcff"}),
                 "{\"prompt_ids\": [\"\udcff\"], \"learner_model\": \"x\"}".encode("utf-8", "surrogatepass")]:
        for accept in ("application/json", ARROW):
            cases.append(("lookup body", "POST", lookup, {"content": body, "headers": {
                "content-type": "application/json", "accept": accept}}))
    group = json.loads(attack_group(1, "hand").model_dump_json())
    pushes = [b"", b"{}", b'{"groups": []}', b'{"groups": null}', json_bytes({"groups": [group] * 513}),
              json_bytes({"groups": [{"rollouts": []}]}), json_bytes({"groups": [group, group]}),
              json_bytes({"groups": [group], "problems": [{"prompt_id": "0" * 16, "dataset": "../x", "problem": "p",
                                                           "answer": "a"}]}),
              json_bytes({"groups": [{"rollouts": [{**r, "group_id": "../x"} for r in group["rollouts"]]}]}),
              json_bytes({"groups": [{"rollouts": [{**r, "created_at": "9999-12-31T23:59:59Z"} for r in group["rollouts"]]}]}),
              json_bytes({"groups": [{"rollouts": [{**r, "completion_token_ids": [-1] * r["num_tokens"]}
                                                   for r in group["rollouts"]]}]}),
              json_bytes({"groups": [{"rollouts": [{**r, "finish_reason": "\udcff"} for r in group["rollouts"]]}]}),
              json_bytes({"groups": [group], "\udcff": 1}),
              json.dumps({"groups": [{"rollouts": [{**r, "completion_text": "\udcff"} for r in group["rollouts"]]}]},
                         ensure_ascii=False).encode("utf-8", "surrogatepass"),
              arrow_bytes([attack_group(2, "hand")])[:100], b"\xff" * 4 + b"\x00" * 4, b"ARROW1\x00\x00" + b"\x00" * 64]
    for body in pushes:
        for content_type in ("application/json", ARROW, "text/plain", "application/json; charset=latin-1", ""):
            cases.append(("push body", "POST", "/v1/groups", {"content": body, "headers": {"content-type": content_type}}))
    for path in ("/v1/stats", "/v1/health", "/v1/groups", lookup, "/v1/rollouts", "/metrics", "/openapi.json"):
        for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"):
            cases.append(("method", method, path, {}))
    for headers in ({"authorization": "Bearer " + "x" * 7000}, {"authorization": "Basic Zm9vOmJhcg=="},
                    {"accept": ARROW * 200}, {"x-junk": "\xff".encode("latin-1") * 100}):
        cases.append(("headers", "GET", "/v1/stats", {"headers": headers}))
    with httpx.Client(base_url=url, timeout=60) as client:
        for what, method, path, kwargs in tqdm(cases, desc="hand-made", unit="request"):
            send(tally, client, f"{what} {method} {path[:60]}", method, path, **kwargs)
    raw = [b"GARBAGE\r\n\r\n", b"GET /v1/stats HTTP/9.9\r\n\r\n", b"POST /v1/groups HTTP/1.1\r\nHost: x\r\n"
           b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", b"POST /v1/groups HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc",
           b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 2000 + b"\r\n", b"GET /v1/stats HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
           b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"]
    raw_outcomes: Counter[str] = Counter()
    for payload in raw:  # malformed HTTP: answered with a 4xx or the connection closed, never a 5xx or a crash
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            try:
                answered = sock.recv(64)
            except OSError:
                answered = b""
        raw_outcomes[answered[9:12].decode() if answered[9:12].isdigit() else "closed"] += 1
    return {"http_requests": len(cases), "malformed_http_on_raw_sockets": dict(raw_outcomes)}


# ------------------------------------------------------------------ 3. mutated pushes


def mutated_pushes(url: str, tally: Tally, flips: int, json_mutations: int, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=60) as client:
        for case in tqdm(range(flips), desc="arrow mutations", unit="push"):
            groups = [attack_group(10_000 + case * 2 + k, "mutated", group_id=f"flip-{case}-{k}") for k in range(2)]
            body = mutate_bytes(rng, arrow_bytes(groups), arrow_bytes([attack_group(case, "other")]))
            response = send(tally, client, f"arrow case {case}", "POST", "/v1/groups", content=body,
                            headers={"content-type": ARROW})
            if response is not None and response.status_code == 200:
                pushed = set(pa.ipc.open_stream(pa.py_buffer(body)).read_all().column("group_id").to_pylist())
                tally.acknowledged |= pushed - set(response.json()["duplicate_groups"])
        for case in tqdm(range(json_mutations), desc="json mutations", unit="push"):
            groups = [attack_group(50_000 + case * 2 + k, "mutated", group_id=f"json-{case}-{k}") for k in range(2)]
            payload = mutate_json(rng, {"groups": [json.loads(g.model_dump_json()) for g in groups]})
            body = json_bytes(payload)
            response = send(tally, client, f"json case {case}", "POST", "/v1/groups", content=body,
                            headers={"content-type": "application/json"})
            if response is not None and response.status_code == 200:
                pushed = {g["rollouts"][0]["group_id"] for g in json.loads(body)["groups"]}
                tally.acknowledged |= pushed - set(response.json()["duplicate_groups"])


# ------------------------------------------------------------------ 4. SIGKILLs while pushing


def kills_while_pushing(server: StoreServer, kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    acknowledged: list[str] = []
    lock = threading.Lock()
    counter = iter(range(10**9))
    result = {"kills": 0, "acknowledged": 0, "readable_after": 0, "manifest_equals_api": 0,
              "partial_files_in_folder": 0}
    for _ in tqdm(range(kills), desc="SIGKILL while pushing", unit="kill"):
        stop = threading.Event()

        def push():
            with StoreClient(server.url, retries=0, timeout_s=30) as client:
                while not stop.is_set():
                    n = next(counter)
                    groups = [attack_group(100_000 + n * 16 + k, "killed", size=8, tokens=256,
                                           group_id=f"kill-{n}-{k}") for k in range(16)]
                    try:
                        client.push_groups(groups)
                    except (StoreError, OSError):
                        return
                    with lock:
                        acknowledged.extend(g.group_id for g in groups)

        threads = [threading.Thread(target=push) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.3, 2.0))
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait()
        stop.set()
        for t in threads:
            t.join(60)
        result["kills"] += 1
        result["partial_files_in_folder"] += sum(
            not p.name.startswith("part-") for p in (server.root / "rollouts").glob("*/*"))
        server.start()
        with StoreClient(server.url) as client:
            stats = client.stats()
            listed = sum(pq.ParquetFile(path).metadata.num_rows for path in live_files(server.root))
            result["manifest_equals_api"] += listed == stats.total_rollouts
    with StoreClient(server.url) as client:
        result["acknowledged"] = len(acknowledged)
        result["readable_after"] = sum(client.get_group(g) is not None for g in acknowledged)
    return result


# ------------------------------------------------------------------ 5. lookups while writers write


def _writer(root: str, model: str, seconds: float, done: multiprocessing.Queue) -> None:
    written, shard = [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        groups = [attack_group(200_000 + shard * 32 + k, model, size=8, tokens=64, step=shard) for k in range(32)]
        write_groups(root, groups)
        written.extend(g.group_id for g in groups)
        shard += 1
    done.put(written)


def lookups_while_writing(server: StoreServer, seconds: float) -> dict:
    prompts = [attack_group(200_000 + i, "x", size=2, tokens=1).prompt_id for i in range(2048)]
    counts = Counter()
    stop = threading.Event()

    def look(seed: int):
        rng = random.Random(seed)
        with StoreClient(server.url, retries=0) as client:
            while not stop.is_set():
                req = PeerLookupRequest(prompt_ids=rng.sample(prompts, rng.choice([1, 8, 64])), learner_model="learner",
                                        groups_per_prompt=rng.choice([1, 4]))
                try:
                    table, _ = client.lookup_peer_table(req)
                    ids = table.column("rollout_id").to_pylist()
                    counts["lookups"] += 1
                    counts["repeated_rows"] += len(ids) - len(set(ids))
                except StoreError as exc:
                    counts[f"error {exc.status_code}"] += 1

    done: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    writers = [multiprocessing.get_context("spawn").Process(target=_writer, args=(str(server.root), f"writer-{w}", seconds, done))
               for w in range(2)]
    threads = [threading.Thread(target=look, args=(i,)) for i in range(8)]
    for p in writers:
        p.start()
    for t in threads:
        t.start()
    for p in writers:
        p.join(seconds + 120)
    written = [g for _ in writers for g in done.get(timeout=60)]
    stop.set()
    for t in threads:
        t.join(60)
    with StoreClient(server.url) as client:
        deadline = time.monotonic() + 60
        while client.stats().total_groups < len(written) and time.monotonic() < deadline:
            time.sleep(0.1)
        readable = sum(client.get_group(g) is not None for g in written[:: max(1, len(written) // 200)])
    return {"seconds": seconds, **counts, "groups_written": len(written),
            "sampled_readable": f"{readable}/{len(written[:: max(1, len(written) // 200)])}"}


# ------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemathesis-examples", type=int, default=100, help="examples per operation and phase")
    parser.add_argument("--flips", type=int, default=300, help="mutated Arrow pushes")
    parser.add_argument("--json-mutations", type=int, default=200, help="mutated JSON pushes")
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs of the server while pushing")
    parser.add_argument("--concurrent-s", type=float, default=30.0, help="seconds of lookups while writers write")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()

    result: dict = {"seed": args.seed, "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    with tempfile.TemporaryDirectory(prefix="store-attack-") as tmp:
        root = Path(tmp) / "store"
        write_groups(root, [attack_group(i, "peer", step=1) for i in range(8)])
        env = {"GRAFT_STORE_COMPACT_INTERVAL_S": "1", "GRAFT_STORE_COMPACT_MIN_FILES": "4"}
        server = StoreServer(root, env=env).start()
        crashes = 0
        try:
            result["schemathesis"] = run_schemathesis(server.url, args.schemathesis_examples, args.seed)
            crashes += crashed(server)
            server.start()
            tally = Tally()
            result["hand_made"] = hand_made(server.url, server.port, tally)
            crashes += crashed(server)
            server.start()
            mutated_pushes(server.url, tally, args.flips, args.json_mutations, args.seed)
            crashes += crashed(server)
            server.start()
            with StoreClient(server.url) as client:
                readable = sum(client.get_group(g) is not None for g in tally.acknowledged)
            result["bad_inputs"] = {**tally.summary(), "groups_acknowledged": len(tally.acknowledged),
                                    "groups_readable_after": readable}
            result["sigkill_while_pushing"] = kills_while_pushing(server, args.kills, args.seed)
            result["lookups_while_writing"] = lookups_while_writing(server, args.concurrent_s)
            crashes += crashed(server)
            result["crashes"] = crashes
            log = server.log_tail(10**8)
            result["server_log_tracebacks"] = log.count("Traceback")
            # the exception line closing each traceback: what went wrong inside
            result["server_log_exceptions"] = sorted(set(re.findall(r"Traceback \(most recent call last\):\n(?:[ ^~].*\n)+(.+)", log)))[:20]
        finally:
            server.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
