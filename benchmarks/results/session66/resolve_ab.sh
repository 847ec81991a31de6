#!/bin/bash
# alternate old (a worktree of 082d49d at OLD_TREE) and new (this checkout, session 66 fix) on each problem, 60 s each
for pair in "resnet50_problem.json resnet50_0.3333.json" "resnet50_adam_problem.json resnet50_adam_0.25.json" "resnet50_problem.json resnet50_0.4.json" "resnet50_adam_problem.json resnet50_adam_0.3333.json"; do
  for tree in OLD_TREE .; do
    echo "== $tree $pair"
    (cd $tree && python benchmarks/results/session65/resolve.py $pair)
  done
done
