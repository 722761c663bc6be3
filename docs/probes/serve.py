"""Server probes (docs/reliability.md, rows S1-S7, S9-S12): run from the repository root with PYTHONPATH=src.

Server probes against a real `dflashkit serve` on a tiny random target with a 32k context."""
import json, os, signal, socket, subprocess, sys, time
import httpx
sys.path.insert(0, "tests")
from datahelpers import CHILD_ENV, save_tiny_target, start_cli
from pathlib import Path
model = Path("/tmp/p/model32k")
if not model.exists():
    save_tiny_target(model, context=1 << 15)
proc = start_cli("serve", "--port", "0", "--max-queue", "2", "--api-key", "k", "--max-body-mb", "1", f"target.path={model}", "target.device=cpu")
line = ""
while "listening on" not in line:
    line = proc.stdout.readline()
url = line.split("listening on", 1)[1].strip().removesuffix("/v1")
H = {"Authorization": "Bearer k"}
def health(): return httpx.get(url + "/health").json()
def raw(body):
    data = json.dumps(body).encode(); host, port = url[7:].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s
# 1. abandoned non-streaming request without max_tokens
s = raw({"prompt": "Once upon a time"} | {"max_tokens": 30000})
while health()["running"] != 1: time.sleep(0.05)
time.sleep(1.0); s.close(); t0 = time.perf_counter()
r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8}, headers=H, timeout=120)
print(f"next request after an abandoned one: HTTP {r.status_code} in {time.perf_counter()-t0:.2f}s; health {health()}")
# 2. 20 MB body
t0 = time.perf_counter()
r = httpx.post(url + "/v1/completions", content=b'{"prompt": "' + b"x" * (20 << 20) + b'"}', headers={**H, "content-type": "application/json"}, timeout=120)
print(f"20 MB body: HTTP {r.status_code} in {time.perf_counter()-t0:.2f}s: {r.json()['error']['message']}")
# 3. api key
print("no key:", httpx.get(url + "/v1/models").status_code, "health without key:", httpx.get(url + "/health").status_code)
# 4. lax fields
for f, v in (("max_tokens", True), ("seed", 2**70)):
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", f: v}, headers=H)
    print(f"{f}={v}: HTTP {r.status_code} {r.json()['error']['message']}")
# 4b. a lone surrogate in a prompt, and a chat message (S10)
for path, body in (("completions", rb'{"prompt": "a\ud800b", "max_tokens": 2}'),
                   ("chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}]}')):
    r = httpx.post(f"{url}/v1/{path}", content=body, headers={**H, "content-type": "application/json"})
    print(f"lone surrogate ({path}): HTTP {r.status_code} {r.headers['content-type']}: {r.json()['error']['message']}")
# 5. queue: 1 running + 2 waiting, then 503
socks = [raw({"prompt": "a", "max_tokens": 30000})]
while health()["running"] != 1: time.sleep(0.05)
socks += [raw({"prompt": "b", "max_tokens": 30000}), raw({"prompt": "c", "max_tokens": 30000})]
while health()["queued"] != 2: time.sleep(0.05)
r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=H)
print(f"queue full: HTTP {r.status_code}, Retry-After {r.headers.get('retry-after')}: {r.json()['error']['message']}")
for s in socks[1:]: s.close()
# 6. SIGTERM with a long request in flight (client still connected)
t0 = time.perf_counter(); proc.send_signal(signal.SIGTERM)
try:
    proc.wait(30); print(f"SIGTERM: exited in {time.perf_counter()-t0:.2f}s (rc {proc.returncode})")
except subprocess.TimeoutExpired:
    print("SIGTERM: still running after 30 s"); proc.kill()

# 7. option values refused before anything loads (S11)
for argv in (["--port", "99999"], ["--max-body-mb", "inf"], ["--shutdown-timeout", "nan"], ["--fail-every", "-1"]):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dflashkit.cli", "serve", *argv, f"target.path={model}"], capture_output=True,
                       text=True, env=CHILD_ENV)
    print(f"serve {' '.join(argv)}: exit {r.returncode} in {time.perf_counter()-t0:.1f}s: {r.stderr.strip()}")
# 8. a host other machines reach, without a key (S12)
p = subprocess.Popen([sys.executable, "-m", "dflashkit.cli", "serve", "--host", "0.0.0.0", "--port", "0", f"target.path={model}",
                      "target.device=cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CHILD_ENV)
line = ""
while "listening on" not in line:
    line = p.stdout.readline()
    if "warning" in line: print("--host 0.0.0.0 without --api-key:", line.strip())
p.terminate(); p.wait()
# 9. SIGTERM to the whole process group, a streamed request in flight (S9)
p = subprocess.Popen([sys.executable, "-m", "dflashkit.cli", "serve", "--port", "0", "--shutdown-timeout", "30",
                      f"target.path={model}", "target.device=cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True, env=CHILD_ENV, start_new_session=True)
line = ""
while "listening on" not in line:
    line = p.stdout.readline()
url = line.split("listening on", 1)[1].strip()
body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
want = httpx.post(url + "/completions", json=body, timeout=120).json()["choices"][0]["text"]
with httpx.stream("POST", url + "/completions", json=body | {"stream": True}, timeout=120) as r:
    events = (json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {"))
    got = [next(events)]
    t0 = time.perf_counter(); os.killpg(p.pid, signal.SIGTERM)
    got += list(events)
done = time.perf_counter() - t0
text = "".join(e["choices"][0]["text"] for e in got if "choices" in e)
p.wait(60)
print(f"SIGTERM to the process group: stream HTTP {r.status_code}, {'complete' if text == want else 'CUT'} "
      f"({len(text)} of {len(want)} characters, errors: {[e['error']['message'] for e in got if 'error' in e]}), "
      f"finished {done:.2f}s after the signal; server exited {time.perf_counter()-t0:.2f}s after it (rc {p.returncode})")
