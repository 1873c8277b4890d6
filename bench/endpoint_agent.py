"""The agent the endpoint benchmarks run (`agent.runner=bench/endpoint_agent.py:feedback`): the same episodes as
`bench/multiturn.py`'s in-process `Feedback` environment, as agent code with an OpenAI client. It asks the
row's question, then after each answer asks to check the step and go on, for `turns` model turns."""

from __future__ import annotations


async def feedback(client, row, turns: int = 3):
    messages = [{"role": "user", "content": row["raw_prompt"]}]
    for turn in range(turns):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        if turn + 1 < turns:
            messages.append({"role": "user", "content": f"Check step {turn + 1} of your answer and continue."})
    return 0.0
