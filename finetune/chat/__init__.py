"""The chat rendering engine: for any Jinja chat template, where each message and each trained turn of a
conversation lands in its rendering and in the rendering's tokens. SFT masks assistant turns with it (data/tokenize.py);
RL renders conversations with it turn by turn. A plain re-export: spans.py renders and locates the trained spans
(regions.py finds each message, turns.py each turn's start and end, shapes.py keeps what a conversation shape shares),
token_ranges.py turns character spans into token ranges.
"""

from finetune.chat.spans import ChatLayout, TurnSpan, chat_layout, render_chat, render_chats

__all__ = ["ChatLayout", "TurnSpan", "chat_layout", "render_chat", "render_chats"]
