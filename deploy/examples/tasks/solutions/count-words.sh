wc -w < data/words.txt > count.txt
