"""regenerate --backend http against a server that cannot answer in time (docs/reliability.md, row S8)."""
import sys

import httpx
sys.path.insert(0, "tests")
from datahelpers import live_server, run_cli
from pathlib import Path
p = Path("/tmp/p/p2.jsonl"); p.write_text('{"id":"a","prompt":"Tell a story."}\n{"id":"b","prompt":"Tell another."}\n')
out = Path("/tmp/p/regen_out.jsonl"); out.unlink(missing_ok=True)
with live_server("target.path=/tmp/p/model32k", "target.device=cpu") as url:
    r = run_cli("regenerate", "--backend", "http", "--url", url, "--timeout", "2", "--retries", "5", "--out", str(out),
                f"data.prompts={p}", "data.max_new_tokens=30000")
    print(r.returncode, r.stdout.strip().splitlines()[:2])
    h = httpx.get(url.removesuffix("/v1") + "/health").json()
    print("server saw", h["requests"], "generation requests for 2 prompts;", h)
