import asyncio, time
from tests.dagster import helpers as h
from tests.dagster.defs_keyed import make_defs, JOB, MEMBERSHIP_SENSOR, BACKLOG_SENSOR

async def test_scratch(js, nats_server, unique_name, warehouse, instance):
    stream = unique_name
    await h.create_group(js, stream)
    evs = h.events_on({1, 3})
    await h.publish(js, stream, evs, len(evs))
    defs = make_defs(stream, nats_server.url, warehouse)
    t = time.perf_counter()
    d = await asyncio.to_thread(h.tick, defs, MEMBERSHIP_SENSOR, instance)
    print("membership", time.perf_counter() - t, d.run_requests, d.cursor, d.skip_message)
    t = time.perf_counter()
    d = await asyncio.to_thread(h.tick, defs, BACKLOG_SENSOR, instance)
    print("backlog", time.perf_counter() - t, d.run_requests, d.cursor, d.skip_message)
    t = time.perf_counter()
    job = defs.resolve_job_def(JOB)
    r = await asyncio.to_thread(lambda: job.execute_in_process(partition_key="1", instance=instance))
    print("run", time.perf_counter() - t, r.success)
    for m in r.asset_materializations_for_node("keyed_events"):
        print(m.metadata)
    print(r.get_asset_check_evaluations())
    t = time.perf_counter()
    r = await asyncio.to_thread(lambda: job.execute_in_process(partition_key="0", instance=instance))
    print("run empty", time.perf_counter() - t, r.success)
