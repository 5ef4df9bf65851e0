"""The save pipeline's steps: ``plan`` (who writes which tensor, decided once), ``staging`` (host copies),
``writer`` (the background thread) and ``commit`` (arrive, ``done``, under deadlines). ``manager`` composes them."""
