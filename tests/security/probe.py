"""A one-asset Dagster probe of the NATS resource (kept free of ``from __future__ import
annotations``: Dagster reads the ``context`` annotation at definition time)."""

from dagster import AssetExecutionContext, MaterializeResult, asset
from nats.aio.client import Client

from cg_pipelines.dagster import NatsResource


@asset
def nats_probe(context: AssetExecutionContext, nats: NatsResource) -> MaterializeResult:
    """Connects with the resource and reads the JetStream account info; logs and records the
    auth mode and the resource's repr (the leak tests grep them)."""

    async def probe(nc: Client) -> int:
        info = await nc.jetstream(timeout=5).account_info()
        return int(info.streams)

    streams = nats.run(probe)
    mode = nats.connect_options().auth_mode
    context.log.info(f"connected to NATS with {mode}; resource {nats!r}; "
                     f"options {nats.connect_options()!r}")
    return MaterializeResult(metadata={"streams": streams, "auth_mode": mode,
                                       "resource": repr(nats)})
