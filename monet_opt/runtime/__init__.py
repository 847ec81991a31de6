from monet_opt.runtime.executor import ScheduleExecutor, ScheduleRuntimeError
from monet_opt.runtime.wrapper import InputShapeMismatch, MonetWrapper

__all__ = ["InputShapeMismatch", "MonetWrapper", "ScheduleExecutor", "ScheduleRuntimeError"]
