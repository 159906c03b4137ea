"""Test helpers (private): `_fake_worker` (a real HTTP worker that speaks the worker protocol) and
`_chat_folder` (a small chat tokenizer folder). Public as `belayer_router.testing`.
"""
