"""What a text stream keeps to go on over a new DecodeBatches call: the ids decoded so far and the text delivered."""
from __future__ import annotations

from rpcserver.errors import Unavailable


class StreamHistory:
    """One stream's ids and text, the prime that carries them onto a new call, and the text reconciled after it.

    The service holds, per stream, a window of ids and a read offset (services/tokenizer/decode_stream.py): the
    ids already turned into text, and after them those held back (a character split across tokens). A prime
    sends the ids up to the last item that returned text, where nothing was held, as one item (its text is the
    decode of those ids: the text delivered), then each later item again as it went (each returned no text), so
    the new call holds what the old one did. Sending all ids as one item would not do: past 16 held ids the
    service emits what it holds, and a character cut at the end would come out as U+FFFD.

    Should the new call's text still differ from what was delivered, the text delivered stands: the new call's
    extra text goes out with the next delta, and text of it already delivered is cut from what it returns next.
    """

    def __init__(self):
        self.ids: list[int] = []  # every token id the service decoded for the stream, in order
        self.settled = 0  # ids up to the last item that returned text: the service held none of them back
        self.unsettled: list[int] = []  # the sizes of the items since, each of which returned no text
        self.text: list[str] = []  # the text delivered, in order
        self.owed = ""  # text the new call returned beyond what was delivered
        self.ahead = ""  # text delivered that the new call has yet to return

    def prime(self, per_item: int) -> list[list[int]]:
        """Each prime item's ids, none over `per_item`; none when nothing was decoded yet."""
        settled = self.ids[:self.settled]
        runs = [settled[i:i + per_item] for i in range(0, len(settled), per_item)]
        at = self.settled
        for size in self.unsettled:
            runs.append(self.ids[at:at + size])
            at += size
        return runs

    def primed(self, texts: list[str]) -> None:
        """Take the prime's text, to reconcile what the new call returns with what was delivered."""
        primed, delivered = "".join(texts), "".join(self.text)
        self.owed = self.ahead = ""
        if primed.startswith(delivered):
            self.owed = primed[len(delivered):]
        elif delivered.startswith(primed):
            self.ahead = delivered[len(primed):]
        else:
            raise Unavailable(f"the tokenizer decodes this stream's {len(self.ids)} ids to other text than the "
                              "text already sent; retry the request")

    def decoded(self, token_ids: list[list[int]], texts: list[str]) -> None:
        """Record items the service answered: each item's ids and its text as the service returned it."""
        for ids, text in zip(token_ids, texts):
            if not ids:
                continue
            self.ids.extend(ids)
            if text:
                self.settled, self.unsettled = len(self.ids), []
            else:
                self.unsettled.append(len(ids))

    def deliver(self, texts: list[str]) -> list[str]:
        """The service's texts, item by item, as they go out: reconciled with the text delivered, and recorded."""
        if not self.ahead and not self.owed:  # the usual case: nothing to reconcile
            self.text.extend(texts)
            return texts
        out = []
        for text in texts:
            if self.ahead:
                n = min(len(self.ahead), len(text))
                if text[:n] != self.ahead[:n]:
                    raise Unavailable("the tokenizer's text for this stream differs from the text already sent "
                                      "after it was carried onto a new call; retry the request")
                self.ahead, text = self.ahead[n:], text[n:]
            if self.owed:
                text, self.owed = self.owed + text, ""
            out.append(text)
        self.text.extend(out)
        return out

    def clear(self) -> None:
        """Forget it all: the stream ended, and nothing will be primed again."""
        self.ids, self.unsettled, self.text, self.settled = [], [], [], 0
