
0123456789abcdef`
addWmainx	parameter"y	parameter"Paddadd"* 