"""Redis URLs with AUTH and with TLS (``rediss://``) work end to end."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from inferq.redisserver import RedisServer, free_port
from tests.support import Stack, sim_body

PASSWORD = "s3cret-pass"


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed, so no test certificate can be made")
    certs = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(certs / "key.pem"),
            "-out",
            str(certs / "cert.pem"),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    tls_port = free_port()
    server = RedisServer(
        password=PASSWORD,
        extra_args=(
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(certs / "cert.pem"),
            "--tls-key-file",
            str(certs / "key.pem"),
            "--tls-ca-cert-file",
            str(certs / "cert.pem"),
            "--tls-auth-clients",
            "no",
        ),
    )
    with server:
        yield server, tls_port, certs / "cert.pem"


def _serve_and_infer(url: str, namespace: str, repo: Path) -> int:
    started: list = []
    try:
        s = Stack(url, namespace, repo, started)
        s.add_worker(("sim",))
        s.start_gateway()
        return s.infer("sim", sim_body(1)).status_code
    finally:
        for thing in reversed(started):
            thing.stop()


def test_a_password_in_the_url_authenticates(secure_redis, namespace, model_repo):
    server, _, _ = secure_redis
    assert _serve_and_infer(server.url, namespace, model_repo) == 200


def test_rediss_urls_use_tls(secure_redis, namespace, model_repo):
    _, tls_port, ca = secure_redis
    url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
    assert _serve_and_infer(url, namespace, model_repo) == 200


def test_a_wrong_password_keeps_the_gateway_unready_with_a_clear_error(
    secure_redis, namespace, model_repo
):
    server, _, _ = secure_redis
    started: list = []
    try:
        s = Stack(f"redis://:wrong@127.0.0.1:{server.port}/0", namespace, model_repo, started)
        s.start_gateway()
        with s.client() as c:
            assert c.get("/v2/health/ready").status_code == 503
            r = c.post("/v2/models/sim/infer", json=sim_body(1))
        assert r.status_code in (404, 503)
        assert "error" in r.json()
    finally:
        for thing in reversed(started):
            thing.stop()
