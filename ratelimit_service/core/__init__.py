"""The pure decision core.

Nothing in this package imports grpc, redis or asyncio, reads a clock or draws a
random number on its own: time and randomness are passed in, so every behaviour
can be tested deterministically and exhaustively.
"""
