"""``engine-adapter study``: the accuracy study (:mod:`.run`), its questions (:mod:`.items`,
over the real words of :mod:`.words`) and its command (:mod:`.cli`)."""

__all__: list[str] = []
