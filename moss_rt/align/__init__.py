"""Word timing: when each word of a take's text is said in its audio (issue 25, docs/words.md).

- :mod:`~moss_rt.align.normalize`: the spoken words of a text (cues out, numbers as words);
- :mod:`~moss_rt.align.base`: the aligner interface and the word record;
- :mod:`~moss_rt.align.sphinx` (offline, English, CPU) and :mod:`~moss_rt.align.ctc` (a CTC model from the hub on
  the engine's device, batched), selected by ``--aligner`` (:mod:`~moss_rt.align.select`);
- :mod:`~moss_rt.align.track`: a take's words while its audio streams (stable once sent);
- :mod:`~moss_rt.align.service`: the worker threads and the bounded queue every alignment goes through;
- captions from the words are :mod:`moss_rt.captions` (the project's one caption writer).
"""
