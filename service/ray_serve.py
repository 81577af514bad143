"""Scale out on Ray Serve: the same FastAPI service, one whole copy per replica, behind Ray's HTTP proxy.

    python -m service.ray_serve --replicas 2                                   # a local Ray instance
    python -m service.ray_serve --address auto --replicas 8 --gpus-per-replica 1   # a running Ray cluster
    python -m service.ray_serve --replicas 2 --session-affinity     # x-session-id picks the replica

Each replica runs `create_app()`: its own ONNX Runtime sessions, dynamic batcher, metrics and attention
cache, reading the repository named by VITSERVE_MODEL_REPOSITORY (it must exist on every node). Ray's proxy
spreads requests over the replicas; a replica takes up to `queue_limit` requests at a time so that its
batcher can form full batches, and the proxy answers 503 beyond that many waiting for a replica. Each
replica's ONNX Runtime uses as many threads as the CPUs it is given. Settings are the service's own
(VITSERVE_* variables), passed on to the replicas.

Attention-map ids live in the replica that made them: with several replicas, GET /attention-map may land
on another one and answer 404. With --session-affinity, requests carrying the same `x-session-id` header
reach the same replica (Ray's experimental consistent-hash router), so a client that sends one with
/classify?attention=true and with GET /attention-map gets its maps; requests without it spread evenly.
"""
import argparse
import os
import signal
import sys
import time

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

from service.core.settings import Settings
from service.http.app import create_app

NAME = "vitserve"  # of the Ray Serve application and of its one deployment


def replica_env(cpus_per_replica: float) -> dict[str, str]:
    """The VITSERVE_* settings of this process for the replicas, with threads to match their CPUs."""
    env = {k: v for k, v in os.environ.items() if k.startswith("VITSERVE_")}
    env.setdefault("VITSERVE_INTRA_OP_THREADS", str(max(1, int(cpus_per_replica))))
    env.setdefault("VITSERVE_DECODE_THREADS", str(max(1, int(cpus_per_replica))))
    return env


def replica_app() -> FastAPI:
    """The service as one replica builds it: its start-up waits for the models to be warm, so Ray marks the
    replica running, and routes to it, only once it can answer."""
    # replicas share a node: no port of their own; and a load call would reach one replica of many (Ray Serve
    # changes a deployment by redeploying it)
    return create_app(Settings(grpc_port=0, model_control="none"), start_when_loaded=True)


def application(replicas: int, cpus_per_replica: float, gpus_per_replica: float,
                session_affinity: bool = False) -> serve.Application:
    """The vitserve deployment, bound and ready for `serve.run`."""
    queue_limit = Settings().queue_limit
    ingress = serve.ingress(replica_app)()  # built in each replica, from the replica's environment
    routing = {"request_router_config": RequestRouterConfig(request_router_class=ConsistentHashRouter)
               } if session_affinity else {}
    deployment = serve.deployment(
        ingress, name=NAME, num_replicas=replicas, max_ongoing_requests=queue_limit,
        max_queued_requests=queue_limit, **routing,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica,
                           "runtime_env": {"env_vars": replica_env(cpus_per_replica)}})
    return deployment.bind()


def running_replicas() -> int:
    return serve.status().applications[NAME].deployments[NAME].replica_states.get("RUNNING", 0)


def main(argv: list[str] | None = None) -> None:
    settings = Settings()
    p = argparse.ArgumentParser(prog="python -m service.ray_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a Ray cluster to join ('auto': the local one); default: start Ray here")
    p.add_argument("--host", default=settings.host)
    p.add_argument("--port", type=int, default=settings.port)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--gpus-per-replica", type=float, default=0.0)
    p.add_argument("--session-affinity", action="store_true",
                   help="requests with the same x-session-id header go to the same replica")
    args = p.parse_args(argv)
    ray.init(address=args.address, include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": args.host, "port": args.port})
    app = application(args.replicas, args.cpus_per_replica, args.gpus_per_replica, args.session_affinity)
    serve.run(app, name=NAME, route_prefix="/")
    print(f"vitserve on Ray Serve: {running_replicas()} replicas running at http://{args.host}:{args.port}",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `docker stop`, `kill`: leave as on Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(NAME)  # only this application: a joined cluster keeps its other ones
        ray.shutdown()


if __name__ == "__main__":
    main()
