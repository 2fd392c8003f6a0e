"""`xpyd demo`: the operator's main job on a local cluster, end to end, with a live view.

`main` runs the steps (build, cluster, Helm, a DisaggregatedServing, a trace replayed with
`xpyd bench`, summary, teardown); `manifest` is the sample pool, `timeline` the pure sampling and
summary maths, `view` the pure text of every line printed, `plot` the PNG.
"""
