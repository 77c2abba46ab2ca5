"""DeepSpeed's learning-rate schedules: the warmups (`schedules`), the cycles (`cycles`), and a
``"scheduler"`` section -> one of them (`build`)."""
