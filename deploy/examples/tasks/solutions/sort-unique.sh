sort -u names.txt > sorted.txt
