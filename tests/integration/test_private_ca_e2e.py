"""https:// with a private CA: a real `conductor-run run --once` through a TLS front on loopback
whose certificate a CA of the test's own signed (openssl), trusted through SSL_CERT_FILE, through
[server] ca_bundle, and not at all (exit 4)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cli import exitcodes
from tests.tlsrelay import Certs, TlsRelay, make_private_ca

from .helpers import World

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # a real bundle without the test's CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_private_ca(tmp_path_factory.mktemp("ca"))


def _front(world: World, certs: Certs) -> TlsRelay:
    port = int(world.server.url.split(":")[2].split("/")[0])
    return TlsRelay(certs, "127.0.0.1", port)


def _untrusting_env() -> dict[str, str]:
    """Every CA variable set (this machine sets them all) to a bundle without the test's CA."""
    bundle = SYSTEM_BUNDLE if Path(SYSTEM_BUNDLE).exists() else ""
    return {name: bundle for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")}


def test_ssl_cert_file_trusts_a_private_ca_and_wins_over_the_others(world: World, certs: Certs) -> None:
    world.define(response_timeout=30)
    workflow = world.start_workflow()
    with _front(world, certs) as relay:
        env = _untrusting_env() | {"SSL_CERT_FILE": str(certs.ca)}  # first in the order, so it is used
        proc = world.run("--once", url=relay.url_for("/api"), command=["/bin/true"], env=env)
        code, err = world.finish(proc)
    assert code == exitcodes.OK, err
    assert world.task_of(workflow)["status"] == "COMPLETED"


def test_ca_bundle_in_the_config_file_is_relative_to_it(world: World, certs: Certs) -> None:
    world.define(response_timeout=30)
    workflow = world.start_workflow()
    conf_dir = world.tmp / "etc"
    conf_dir.mkdir()
    shutil.copy(certs.ca, conf_dir / "private-ca.pem")
    config = conf_dir / "conductor.toml"
    config.write_text('[server]\nca_bundle = "private-ca.pem"\n')
    with _front(world, certs) as relay:
        # The file is below the environment in precedence: no CA variable may be set for it to count.
        env = {name: "" for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")}
        proc = world.run("--config", str(config), "--once", url=relay.url_for("/api"), command=["/bin/true"],
                         env=env)
        code, err = world.finish(proc)
    assert code == exitcodes.OK, err
    assert world.task_of(workflow)["status"] == "COMPLETED"


def test_the_ca_bundle_flag_wins_over_the_environment(world: World, certs: Certs) -> None:
    world.define(response_timeout=30)
    world.start_workflow()
    with _front(world, certs) as relay:
        proc = world.run("--once", "--ca-bundle", str(certs.ca), url=relay.url_for("/api"),
                         command=["/bin/true"], env=_untrusting_env())
        code, err = world.finish(proc)
    assert code == exitcodes.OK, err


def test_an_untrusted_certificate_is_exit_4_at_start(world: World, certs: Certs) -> None:
    with _front(world, certs) as relay:
        proc = world.run("--once", url=relay.url_for("/api"), command=["/bin/true"], env=_untrusting_env())
        code, err = world.finish(proc)
        assert relay.handshake_failures >= 1
    assert code == exitcodes.UNREACHABLE, err
    assert "server unreachable" in err and "Traceback" not in err


def test_a_missing_ca_bundle_is_a_config_error_naming_its_variable(world: World, certs: Certs) -> None:
    missing = world.tmp / "no-such-ca.pem"
    env = _untrusting_env() | {"SSL_CERT_FILE": str(missing)}
    proc = world.run("--once", command=["/bin/true"], env=env)
    code, err = world.finish(proc)
    assert code == exitcodes.CONFIG, err
    assert f"ca_bundle {missing} (from env SSL_CERT_FILE)" in err and "No such file" in err
    assert err.count("\n") == 1, err
