"""``import stepwatch.auto``: the one line. Equals ``stepwatch.init()`` configured from the
environment; a bad ``STEPWATCH_*`` value raises here, naming the variable and the valid values."""

from . import init as _init

session = _init()
