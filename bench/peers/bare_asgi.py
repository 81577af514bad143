"""The floor under every HTTP path: an ASGI app that reads the request body whole and answers a fixed JSON. Run
under the server vitserve runs on (uvicorn, httptools, uvloop), it is what the server itself costs per request.

    python -m uvicorn --app-dir bench/peers bare_asgi:app --port PORT --loop uvloop --http httptools --no-access-log
"""

ANSWER = b'{"results": []}'
HEAD = {"type": "http.response.start", "status": 200,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]}


async def app(scope, receive, send):
    if scope["type"] != "http":  # lifespan: nothing to start
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(HEAD)
    await send({"type": "http.response.body", "body": ANSWER})
