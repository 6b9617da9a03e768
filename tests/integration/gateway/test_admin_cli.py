"""`switchyard admin` against a real gateway: every admin endpoint, tables and CSV, the admin
key from a file, and a gateway that is down answered in one line naming the URL."""

import json
import time

from cli.main import main as cli_main
from tests.integration.gateway.conftest import ADMIN, gateway_stack
from tests.support.worker import free_port

CASCADE = {"cascade_small_pool": "small", "cascade_large_pool": "large"}
BODY = {"model": "small", "prompt": [5, 6, 7, 8], "max_tokens": 6}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_admin_cli_covers_tenants_keys_routing_usage_and_fleet(redis_url, tmp_path, capsys):
    with gateway_stack(redis_url, **CASCADE) as s:
        key_file = tmp_path / "admin-key"
        key_file.write_text(ADMIN + "\n")
        a = ["admin", "--url", s.url, "--admin-key-file", str(key_file)]
        code, out, _ = run(capsys, *a, "tenant", "create", "acme", "--tokens-per-minute", "900",
                           "--max-concurrent", "3")  # fmt: skip
        assert code == 0 and json.loads(out)["limits"]["max_concurrent"] == 3
        code, out, _ = run(capsys, *a, "--json", "tenant", "update", "acme",
                           "--tokens-per-day", "5000", "--clear", "max_concurrent")  # fmt: skip
        limits = json.loads(out)["limits"]
        assert code == 0 and limits["tokens_per_minute"] == 900 and limits["tokens_per_day"] == 5000
        assert limits["max_concurrent"] is None
        code, out, _ = run(capsys, *a, "tenant", "list")
        assert code == 0 and out.splitlines()[0].split()[:2] == ["tenant", "name"]
        assert "acme" in out and "900" in out
        code, _, err = run(capsys, *a, "tenant", "update", "acme", "--model", "medium")
        assert code == 1 and err.startswith("error: 400") and "medium" in err
        code, out, err = run(capsys, *a, "key", "create", "acme", "--name", "ci",
                             "--expires-in", "30")  # fmt: skip
        created = json.loads(out)
        assert code == 0 and created["expires_at"] > time.time() + 29 * 86400
        assert "shown once" in err
        with s.client(created["key"]) as c:
            assert c.post("/v1/completions", json=BODY).status_code == 200
        code, out, _ = run(capsys, *a, "key", "list", "acme")
        assert code == 0 and created["prefix"] in out and "last used" in out

        code, out, _ = run(capsys, *a, "routing", "set", "overflow_max_wait_s=2.5",
                           "tenant_thresholds.acme=0.4")  # fmt: skip
        assert code == 0 and json.loads(out)["tenant_thresholds"] == {"acme": 0.4}
        code, out, _ = run(capsys, *a, "routing", "set", "overflow_max_wait_s=3")
        doc = json.loads(out)
        assert doc["overflow_max_wait_s"] == 3 and doc["tenant_thresholds"] == {"acme": 0.4}
        code, out, _ = run(capsys, *a, "routing", "show")
        assert code == 0 and json.loads(out)["overflow_max_wait_s"] == 3
        code, out, _ = run(capsys, *a, "routing", "audit")
        assert code == 0 and len(out.splitlines()) == 3  # header + two changes

        deadline = time.monotonic() + 10
        while True:
            code, out, _ = run(capsys, *a, "usage", "--by", "model")
            if "small" in out or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert code == 0 and "by model" in out
        row = next(line.split() for line in out.splitlines() if line.startswith("acme"))
        assert row[1:3] == ["small", "1"] and row[-2] == "10"
        code, out, _ = run(capsys, *a, "usage", "--by", "key", "--csv")
        assert code == 0 and out.startswith("tenant_id,key,requests")
        assert created["key_id"] in out
        code, out, _ = run(capsys, *a, "fleet")
        assert code == 0 and "pool small" in out
        code, out, _ = run(capsys, *a, "key", "revoke", created["key_id"])
        assert code == 0 and json.loads(out) == {"revoked": created["key_id"]}
        code, out, _ = run(capsys, *a, "tenant", "delete", "acme")
        assert code == 0
        code, _, err = run(capsys, *a, "tenant", "show", "acme")
        assert code == 1 and err.startswith("error: 404")
        code, _, err = run(
            capsys, "admin", "--url", s.url, "--admin-key", "wrong", "tenant", "list"
        )
        assert code == 1 and "401" in err


def test_admin_cli_with_the_gateway_down_is_one_line_naming_the_url(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = run(capsys, "admin", "--url", url, "--admin-key", "k", "tenant", "list")
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and url in err and "Traceback" not in err
