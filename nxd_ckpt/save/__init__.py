"""The save pipeline's steps, one module each: ``capture`` (the state read at the call, the model's state dict
built once), ``plan`` (who writes which tensor, decided once), ``stage`` (the staging strategies, over ``staging``
and ``budget``), ``write`` (this rank's files), ``writer`` (the background thread) and ``commit`` (a tag's atomic
commit, begin to ``done``, over ``barrier``). ``pipeline`` composes them; ``manager`` runs it."""
