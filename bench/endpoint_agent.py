"""The agent the endpoint benchmarks run (`agent.runner=bench/endpoint_agent.py:feedback`): the same episodes as
`bench/multiturn.py`'s in-process `Feedback` environment, as agent code with an OpenAI client. It asks the
row's question, then after each answer asks to check the step and go on, for `turns` model turns. It reports
its requests' mean and longest latency (metrics `request_s`, `request_s_max`).

With `big_mb`, the trajectories of row 0 send a message of that many MB instead of their first check request:
the endpoint refuses it (no prompt holds it), and their episode ends there (`bench/multiturn.py
--big-message-mb`: what one large message costs the other trajectories)."""

from __future__ import annotations

import time


async def feedback(client, row, turns: int = 3, big_mb: float = 0.0):
    import openai

    big = "x" * int(big_mb * 2**20) if big_mb and row["index"] == 0 else None
    messages = [{"role": "user", "content": row["raw_prompt"]}]
    seconds = []
    for turn in range(turns):
        start = time.perf_counter()
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError:
            if big is None or turn == 0:
                raise
            return {"reward": 0.0, "metrics": {"refused_big_message": 1.0}}
        seconds.append(time.perf_counter() - start)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        if turn + 1 < turns:
            text = big if big is not None and turn == 0 else f"Check step {turn + 1} of your answer and continue."
            messages.append({"role": "user", "content": text})
    return {"reward": 0.0, "metrics": {"request_s": sum(seconds) / len(seconds), "request_s_max": max(seconds)}}
