"""The web edge: the FastAPI app, its routes, middleware, the uvicorn protocol, error answers and schemas.

May import every part.
"""
