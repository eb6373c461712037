def fizz(n):
    return "Fizz" if n % 3 == 0 else str(n)
