#!/bin/bash
R=/work/main/benchmarks/results
K=$R/session21/frontier_adam/schedules/resnet50_problem.json
A=$R/session21/resnet50_adam_problem.json
C=$R/session51/problem_resnet50_b8_i224_calibrated.json
mkdir -p /tmp/s54/logs
cd /tmp
for row in "$K 0.5 kept" "$K 0.4 kept" "$K 0.33 kept" "$A 0.4 adam" "$A 0.33 adam" "$A 0.25 adam" "$C 0.4 cal" "$C 0.33 cal" "syn350 0.4 syn" "syn350 0.33 syn"; do
  set -- $row
  for v in before after; do
    PYTHONPATH=/tmp/$v python /tmp/s54/gap_row.py $1 $2 > /tmp/s54/logs/${v}_$3_$2.log 2>&1
    echo "$v $3 $(grep RESULT /tmp/s54/logs/${v}_$3_$2.log)" >> /tmp/s54/rows.txt
  done
done
echo done >> /tmp/s54/rows.txt
